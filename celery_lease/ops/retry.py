"""An operator's retry of an ended job, shared by the dashboard's retry buttons, the
API's ``POST /api/v1/jobs/{id}/retry`` and ``celery -A proj lease retry``.

A job is retried at most once: its retry's id is derived from its own (``retry_id``),
so a second retry (a double click, a POST sent again after its reply was lost, two
operators at once) finds that job and makes none. Every retry starts above every
fencing token of the job it retries, which is terminal and whose tokens never move
again; were a job retried twice, both retries would hand out the same tokens. To try
once more, retry the retry.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

from celery_lease.lifecycle import transition as tr

if TYPE_CHECKING:
    from celery_lease.extension import CeleryLease

#: The namespace of retry ids (uuid5 of the retried job's id).
_RETRY_NAMESPACE = uuid.UUID("5b0f8a3e-2c1d-4e7a-9f60-7d2c1e4b8a93")


class NotRetried(Exception):
    """Nothing was made: no such job (of the tenant), or one that is not failed,
    expired or cancelled; the message says which."""


class AlreadyRetried(NotRetried):
    """The job was retried before: ``retry_id`` is its retry."""

    def __init__(self, job_id: str, retry_id: str) -> None:
        super().__init__(f"job {job_id} was already retried as {retry_id}: retry that job instead")
        self.job_id, self.retry_id = job_id, retry_id


def retry_id(job_id: str) -> str:
    """The one id a retry of ``job_id`` can have."""
    return str(uuid.uuid5(_RETRY_NAMESPACE, str(uuid.UUID(str(job_id)))))


def retry_as_new(leases: CeleryLease, job_id: str, *, tenant: str | None = None) -> str:
    """Submit a failed, expired or cancelled job (of ``tenant``, when given) again as a
    new job: same kind, payload, queue, priority, run and tenant, a fresh attempt
    budget, the old job as its parent, fencing tokens above every one the old job
    handed out (statement ``retry_as_new_job``). Returns the new job's id. Raises
    NotRetried when nothing was made (AlreadyRetried: the job was retried before).
    The old job stays as it ended."""
    new_id = retry_id(job_id)
    params = {"new_id": new_id, "job_id": job_id}
    made = leases.lifecycle.execute(tr.RETRY_AS_NEW, params, build={"tenant": tenant})
    if made:
        return str(made[0]["id"])
    if leases.store.get_view(new_id, tenant=tenant) is not None:
        raise AlreadyRetried(job_id, new_id)
    job = leases.store.get_view(job_id, tenant=tenant)
    if job is None:
        raise NotRetried(f"no job {job_id}")
    raise NotRetried(f"job {job_id} is {job['status']}: only failed, expired or cancelled jobs are retried")
