"""The metrics' reads (celery_lease.ops.metrics), run at scrape time."""

from __future__ import annotations

import functools

import sqlalchemy as sa

from celery_lease.db.schema import events
from celery_lease.db.statements.common import (
    _c,
    _lease_elapsed,
    _seconds,
    db_now,
    db_now_plus,
    epoch_seconds,
)
from celery_lease.db.statements.history import everywhere
from celery_lease.status import Status


@functools.cache
def job_totals() -> sa.Select:
    """Per (status, kind): jobs, attempts claimed, leases lost (reaped or interrupted)."""
    return everywhere(
        sa.select(_c.status, _c.kind, sa.func.count(), sa.func.sum(_c.attempt), sa.func.sum(_c.lease_losses)).group_by(
            _c.status, _c.kind
        )
    )


@functools.cache
def event_totals() -> sa.Select:
    """Per (event, detail prefix): rows of the run event logs. The detail tells a
    requeue by restart recovery ("interrupted by restart: ...") from a shutdown handoff."""
    restart = events.c.detail.startswith("interrupted by restart")
    return everywhere(sa.select(events.c.event, restart.label("restart"), sa.func.count()).group_by(events.c.event, restart))


@functools.cache
def lease_health() -> sa.Select:
    """Running jobs, the age of the stalest lease renewal, leases past expiry (the
    reaper's backlog) and due pending jobs without a fresh wakeup (the sweeper's)."""
    running = _c.status == Status.RUNNING.value
    # A lease is renewed to now + lease_seconds, so its last renewal (or claim) was
    # lease_seconds before it expires.
    renewal_age = epoch_seconds(db_now()) - epoch_seconds(_c.lease_expires_at) + _c.lease_seconds
    unswept = sa.and_(
        _c.status == Status.PENDING.value,
        sa.or_(_c.run_after.is_(None), _c.run_after <= db_now()),
        sa.or_(_c.woken_at.is_(None), _c.woken_at < db_now_plus(-_seconds("stale_seconds"))),
        _c.held.is_(None),
    )
    return sa.select(
        sa.func.count().filter(running),
        sa.func.max(sa.case((running, renewal_age))),
        sa.func.count().filter(_lease_elapsed),
        sa.func.count().filter(unswept),
    )
