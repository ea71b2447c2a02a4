"""The batched claim (``lease_claim_ahead``): a worker's main process claims every
wakeup it received in a short window with ONE durable statement, and a lost reply is
settled by :func:`adopt_batch` (celery_lease/worker/ahead.py).

The same update as :func:`celery_lease.db.statements.claim.claim` for many jobs: each
delivered (id, task) pair that is pending, due and of no paused kind goes to running for
one attempt (attempt + 1, lease_generation + 1: its fencing token), or to cancelled
when its run is cancelled (the returned ``status`` says which), with its run event. It
does no priority swap: each delivery claims the job it names.

The rows are locked in id order first (``locked``): two workers claiming overlapping
batches then wait for each other in one order and never deadlock; a row another claim
took meanwhile is no longer pending when its lock is granted and drops out.
"""

from __future__ import annotations

import functools
from typing import Any

import sqlalchemy as sa

from celery_lease.db.durability import durable
from celery_lease.db.schema import jobs, pauses, runs
from celery_lease.db.statements.claim import CLAIMED_COLUMNS, RUN_CANCELLED, claimed_values
from celery_lease.db.statements.common import _PENDING, _c, _due, db_now, db_now_plus
from celery_lease.db.statements.events import _events_of
from celery_lease.status import Event, Status


@functools.cache
def claim_batch() -> Any:
    """claim_batch: :deliveries, a list of (job id, wakeup task) pairs, claimed by :owner."""
    wanted = sa.tuple_(_c.id, _c.task).in_(sa.bindparam("deliveries", expanding=True))
    locked = (
        sa.select(_c.id)
        .where(wanted, _c.status == _PENDING, _due(_c), ~sa.exists().where(pauses.c.kind == _c.kind))
        .order_by(_c.id)
        .with_for_update(of=jobs)
        .cte("locked")
        .prefix_with("MATERIALIZED")
    )
    member = jobs.alias("member")
    run = (
        sa.select(member.c.id.label("job_id"), runs.c.cancelled_at.is_not(None).label("cancelled"))
        .select_from(runs.join(member, runs.c.id == member.c.run_id))
        .where(member.c.id.in_(sa.select(locked.c.id)))
        .with_for_update(read=True, of=runs)
        .cte("run")
        .prefix_with("MATERIALIZED")
    )
    cancelled = sa.func.coalesce(sa.select(run.c.cancelled).where(run.c.job_id == _c.id).scalar_subquery(), sa.false())

    update = (
        sa.update(jobs)
        .where(_c.id.in_(sa.select(locked.c.id)), _c.status == _PENDING)
        .values(**claimed_values(cancelled))
        .returning(*CLAIMED_COLUMNS)
    )
    claimed = update.cte("claimed")
    is_cancelled = claimed.c.status == Status.CANCELLED.value
    event = sa.case((is_cancelled, sa.literal(Event.CANCELLED.value)), else_=sa.literal(Event.CLAIMED.value))
    detail = sa.case((is_cancelled, sa.literal(RUN_CANCELLED)), else_=sa.bindparam("owner", type_=sa.Text))
    return durable(sa.select(claimed).add_cte(_events_of(claimed, event, detail, "logged")))


@functools.cache
def adopt_batch() -> sa.Update:
    """adopt_batch: a batched claim whose reply was lost may have landed. Its jobs are
    those of :job_ids running under this very :owner (the main process, which sends one
    batch at a time); their leases restart from now, as the claim would have set them.
    The caller adopts those whose generation it never dispatched."""
    return durable(
        sa.update(jobs)
        .where(
            _c.id.in_(sa.bindparam("job_ids", expanding=True)),
            _c.status == Status.RUNNING.value,
            _c.lease_owner == sa.bindparam("owner"),
        )
        .values(lease_expires_at=db_now_plus(_c.lease_seconds), updated_at=db_now())
        .returning(*CLAIMED_COLUMNS)
    )
