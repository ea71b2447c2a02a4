"""Cancelling jobs and runs (producer, revoke broadcasts): a revoking statement, which
bumps the lease generation of any attempt still running."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import sqlalchemy as sa

from celery_lease.db.durability import durable
from celery_lease.db.schema import jobs, runs
from celery_lease.db.statements.attempt_log import close_attempt
from celery_lease.db.statements.common import (
    _ACTIVE,
    REQUEUED_COLUMNS,
    _c,
    _lease_cleared,
    db_now,
)
from celery_lease.status import AttemptOutcome, Status


def cancel_jobs(
    *, job_id: str | None = None, run_id: str | None = None, ids: Sequence[str] = (), tasks: Sequence[str] = ()
) -> sa.Update:
    """cancel_jobs: pending/running -> cancelled at once; revokes any lease. One job, a
    run's jobs, or (a revoke broadcast) the jobs among ``ids`` whose task is one of
    ``tasks``: one statement whatever the number of ids, an id that is no job costs an
    index probe. Returns, per cancelled job, what its follow-ups need (REQUEUED_COLUMNS)."""
    if job_id is not None:
        where = _c.id == job_id
    elif run_id is not None:
        where = _c.run_id == run_id
    else:
        where = sa.and_(_c.id.in_(list(ids)), _c.task.in_(list(tasks)))
    return durable(
        sa.update(jobs)
        .where(where, _c.status.in_(_ACTIVE))
        .values(
            status=Status.CANCELLED.value,
            lease_generation=_c.lease_generation + 1,
            finished_at=db_now(),
            updated_at=db_now(),
            attempts=close_attempt(AttemptOutcome.CANCELLED),  # a running job's attempt
            **_lease_cleared,
        )
        .returning(*REQUEUED_COLUMNS)
    )


@functools.cache
def cancel_run() -> sa.Update:
    return sa.update(runs).where(runs.c.id == sa.bindparam("run_id"), runs.c.cancelled_at.is_(None)).values(cancelled_at=db_now())
