"""Statements about attempts whose worker process is known to be dead."""

from __future__ import annotations

import functools

import sqlalchemy as sa

from celery_lease.db.schema import jobs
from celery_lease.db.statements.common import _c, db_now, db_now_plus
from celery_lease.status import Status


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
    """expire_leases_of: every running lease of one process known to be dead (:owner,
    ``node/pid/boot``, or a thread's ``node/pid.T/boot``: lifecycle/owner.owner_of)
    elapses now, so the reaper requeues its jobs at once: a pool process running a
    many-job claim held many (worker/many_claim.py)."""
    guard = sa.and_(_c.status == Status.RUNNING.value, _c.lease_owner == sa.bindparam("owner"))
    return sa.update(jobs).where(guard).values(lease_expires_at=db_now_plus(sa.literal(-1.0)), updated_at=db_now())
