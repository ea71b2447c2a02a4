"""An operator's retry of an ended job, shared by the dashboard's retry buttons and the
API's ``POST /api/v1/jobs/{id}/retry``."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

from celery_lease.lifecycle import transition as tr

if TYPE_CHECKING:
    from celery_lease.extension import CeleryLease


def retry_as_new(leases: CeleryLease, job_id: str, *, tenant: str | None = None) -> str | None:
    """Submit a failed, expired or cancelled job (of ``tenant``, when given) again as a
    new job: same kind, payload, queue, priority, run and tenant, a fresh attempt
    budget, the old job as its parent, fencing tokens above every one the old job
    handed out (statement ``retry_as_new_job``). Returns the new job's id; None when
    ``job_id`` (a valid UUID) names no such job. The old job stays as it ended."""
    params = {"new_id": str(uuid.uuid4()), "job_id": job_id}
    made = leases.lifecycle.execute(tr.RETRY_AS_NEW, params, build={"tenant": tenant})
    return str(made[0]["id"]) if made else None
