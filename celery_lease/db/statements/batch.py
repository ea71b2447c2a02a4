"""The statements of a batched kind (``@leases.job(kind=..., batch=N)``): many jobs
claimed by one statement, many successes completed by one statement (PostgreSQL).

Both are durable (:mod:`celery_lease.db.durability`): the claim issues a fencing token
per row, the completion ends attempts; neither may be lost to a crash of PostgreSQL
after the worker acted on it. Both run through the lifecycle pipeline
(:mod:`celery_lease.lifecycle.batch`), whose Landing settles a lost reply by asking
the server whether the transaction committed.
"""

from __future__ import annotations

import functools

import sqlalchemy as sa

from celery_lease.db.schema import ID, jobs, pauses, runs
from celery_lease.db.statements.claim import CLAIMED_COLUMNS, RUN_CANCELLED, claimed_values
from celery_lease.db.statements.common import _PENDING, _c, _due
from celery_lease.db.statements.events import _events_of, logged
from celery_lease.status import Event, Status


@functools.cache
def claim_batch() -> sa.Select:
    """claim_batch: up to :n due pending jobs of the kind and queue of the delivered job
    :job_id (whose task must be :wakeup_task: a wakeup is untrusted input), claimed for
    :owner in ONE statement.

    Each row claimed gets what a single claim gives it: attempt + 1, lease_generation + 1
    (its own fencing token), a lease of its own ``lease_seconds``, its ``claimed`` run
    event (in the statement). A job of a cancelled run is made ``cancelled`` instead and
    must not start (``status`` says which). The delivered job need not be pending: any
    delivery of a batched kind claims what is due (its own job may already run in
    another batch). Nothing of a paused kind is claimed; held jobs are not taken.

    Rows are picked best priority first, then (a fair kind) smallest fair_key, then
    oldest, FOR UPDATE SKIP LOCKED: two
    batches claiming at once take different rows, neither waits. One row more than :n
    is picked and not claimed: its id comes back as ``next_id`` on every row, so a full
    batch can wake the kind again for what is left (worker/batch.py); NULL when the
    batch took everything due. ``paused``: the delivered job's kind is paused.
    """
    named = jobs.alias("named")
    delivered = (
        sa.select(named.c.kind, named.c.queue)
        .where(named.c.id == sa.bindparam("job_id", type_=ID), named.c.task == sa.bindparam("wakeup_task", type_=_c.task.type))
        .cte("delivered")
    )
    limit = sa.bindparam("n", type_=sa.Integer)
    picked = (
        sa.select(_c.id, _c.priority, _c.fair_key, _c.created_at)
        .select_from(jobs.join(delivered, sa.and_(_c.kind == delivered.c.kind, _c.queue.is_not_distinct_from(delivered.c.queue))))
        .where(
            # (Literal 'pending' and held IS NULL: the wakeup index's predicate, which a
            # prepared generic plan can only use when the WHERE visibly implies it.)
            _c.status == _PENDING,
            _c.held.is_(None),
            _c.task == sa.bindparam("wakeup_task"),
            _due(_c),
            ~sa.exists().where(pauses.c.kind == _c.kind),
        )
        # A fair kind's in fair order (statements/fair.py: a batch is a weighted mix of
        # tenants); fair_key is NULL for every job of any other kind.
        .order_by(_c.priority.desc(), _c.fair_key, _c.created_at)
        .limit(limit + 1)
        .with_for_update(of=jobs, skip_locked=True)
        .cte("picked")
        .prefix_with("MATERIALIZED")
    )
    # (Numbered apart: PostgreSQL takes no window function beside FOR UPDATE.)
    order = (picked.c.priority.desc(), picked.c.fair_key, picked.c.created_at)
    ranked = sa.select(picked.c.id, sa.func.row_number().over(order_by=order).label("rank")).cte("ranked")
    cancelled = sa.exists().where(runs.c.id == _c.run_id, runs.c.cancelled_at.is_not(None))
    claimed = (
        sa.update(jobs)
        .where(_c.id == ranked.c.id, ranked.c.rank <= limit)
        .values(**claimed_values(cancelled))
        .returning(*CLAIMED_COLUMNS)
        .cte("claimed")
    )
    was_cancelled = claimed.c.status == Status.CANCELLED.value
    event = sa.case((was_cancelled, sa.literal(Event.CANCELLED.value)), else_=sa.literal(Event.CLAIMED.value))
    detail = sa.case((was_cancelled, sa.literal(RUN_CANCELLED)), else_=sa.bindparam("owner", type_=sa.Text))
    following = sa.select(ranked.c.id).where(ranked.c.rank == limit + 1).scalar_subquery()
    # Always at least one row: nothing claimed is one row of NULLs but ``paused``, so a
    # delivery that found nothing learns in this same statement whether a pause is why.
    paused = sa.exists().where(pauses.c.kind == sa.select(delivered.c.kind).scalar_subquery())
    flags = sa.select(paused.label("paused")).cte("flags")
    return logged(
        sa.select(claimed, following.label("next_id"), flags.c.paused)
        .select_from(flags.outerjoin(claimed, sa.true()))
        .add_cte(_events_of(claimed, event, detail, "logged"))
    )
