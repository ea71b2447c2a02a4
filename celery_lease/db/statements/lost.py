"""Statements about attempts whose worker process is known to be gone."""

from __future__ import annotations

import functools

import sqlalchemy as sa

from celery_lease.db.schema import jobs
from celery_lease.db.statements.common import _c, db_now, db_now_plus
from celery_lease.status import Status


@functools.cache
def expire_lost_lease() -> sa.Update:
    """expire_lost_lease: the lease of one attempt whose process died (Celery reported
    WorkerLostError: a pool process the OOM killer took) elapses now, so the reaper
    requeues or expires the job at once instead of after ``lease_seconds``. Guarded by
    the attempt's owner and fencing generation: no other attempt's lease is touched."""
    guard = sa.and_(
        _c.id == sa.bindparam("job_id"),
        _c.status == Status.RUNNING.value,
        _c.lease_owner == sa.bindparam("owner"),
        _c.lease_generation == sa.bindparam("generation"),
    )
    return sa.update(jobs).where(guard).values(lease_expires_at=db_now_plus(sa.literal(-1.0)), updated_at=db_now())


@functools.cache
def running_owners() -> sa.Select:
    """running_owners: the distinct lease owners of running jobs matching :pattern
    (``%/<boot>``: one worker boot's processes)."""
    return (
        sa.select(_c.lease_owner)
        .where(_c.status == Status.RUNNING.value, _c.lease_owner.like(sa.bindparam("pattern", type_=sa.Text)))
        .distinct()
    )


@functools.cache
def expire_leases_of() -> sa.Update:
    """expire_leases_of: every running lease of one process known to be gone (:owner,
    ``node/pid/boot``, names exactly one process) elapses now, so the reaper requeues
    its jobs at once: a batched kind's pool process held many (worker/batch.py)."""
    guard = sa.and_(_c.status == Status.RUNNING.value, _c.lease_owner == sa.bindparam("owner"))
    return sa.update(jobs).where(guard).values(lease_expires_at=db_now_plus(sa.literal(-1.0)), updated_at=db_now())
