"""The many-job claim (PostgreSQL): up to :n due jobs of a kind and queue claimed by one
statement (:n is the kind's ``batch=`` when it declares one, worker/many_claim.py).

Durable (:mod:`celery_lease.db.durability`): the claim issues a fencing token per row,
which may not be lost to a crash of PostgreSQL after the worker acted on it. Executed as
every claim (:mod:`celery_lease.lifecycle.many_claim`), whose Landing settles a lost reply by asking
the server whether the transaction committed.
"""

from __future__ import annotations

import functools
from typing import Any

import sqlalchemy as sa

from celery_lease.db.durability import durable
from celery_lease.db.schema import ID, jobs, limits, pauses, runs
from celery_lease.db.statements.claim import CLAIMED_COLUMNS, RUN_CANCELLED, claimed_values
from celery_lease.db.statements.common import _PENDING, _c, _due, db_now
from celery_lease.db.statements.events import _events_of, logged
from celery_lease.db.statements.flow import _new_window, _rate_budget, count_rate_claims
from celery_lease.db.statements.in_force import in_force_concurrency, in_force_rate, not_overridden, running_like
from celery_lease.status import Event, Held, Status


@functools.cache
def claim_many() -> sa.Select:
    """claim_many: up to :n due pending jobs of the kind and queue of the delivered job
    :job_id (whose task must be :wakeup_task: a wakeup is untrusted input), claimed for
    :owner in ONE statement.

    Each row claimed gets what a single claim gives it: attempt + 1, lease_generation + 1
    (its own fencing token), a lease of its own ``lease_seconds``, its ``claimed`` run
    event (in the statement). A job of a cancelled run is made ``cancelled`` instead and
    must not start (``status`` says which). The delivered job need not be pending: any
    delivery of a many-job claim's kind claims what is due (its own job may already run in
    another many-job claim). Nothing of a paused kind is claimed; held jobs are not taken.

    Rows are picked as :func:`_picked` says (priority, fair order, age; SKIP LOCKED).
    One row more than :n is picked and not claimed: its id comes back as ``next_id`` on every row, so a full
    claim can wake the kind again for what is left (worker/many_claim.py); NULL when the
    claim took everything due. ``paused``: the delivered job's kind is paused.
    """
    delivered = _delivered()
    limit = sa.bindparam("n", type_=sa.Integer)
    # No operator's override limits the kind: else nothing is claimed and ``overridden``
    # says why (the caller claims again with claim_many_limited), so a claim made after
    # an override committed never runs past it.
    picked = _picked(delivered, limit, _c.held.is_(None), guard=not_overridden(delivered.c.kind))
    ranked = sa.select(picked.c.id, sa.func.row_number().over(order_by=_order(picked)).label("rank")).cte("ranked")
    cancelled = sa.exists().where(runs.c.id == _c.run_id, runs.c.cancelled_at.is_not(None))
    claimed = (
        sa.update(jobs)
        .where(_c.id == ranked.c.id, ranked.c.rank <= limit)
        .values(**claimed_values(cancelled))
        .returning(*CLAIMED_COLUMNS)
        .cte("claimed")
    )
    event, detail = _claim_event(claimed)
    following = sa.select(ranked.c.id).where(ranked.c.rank == limit + 1).scalar_subquery()
    # Always at least one row: nothing claimed is one row of NULLs but ``paused``, so a
    # delivery that found nothing learns in this same statement whether a pause is why.
    kind = sa.select(delivered.c.kind).scalar_subquery()
    paused = sa.exists().where(pauses.c.kind == kind)
    flags = sa.select(paused.label("paused"), (~not_overridden(kind)).label("overridden")).cte("flags")
    return durable(
        logged(
            sa.select(claimed, following.label("next_id"), flags.c.paused, flags.c.overridden)
            .select_from(flags.outerjoin(claimed, sa.true()))
            .add_cte(_events_of(claimed, event, detail, "logged"))
        )
    )


#: No bound: a limit not in force (as flow.top_up spells it).
_MOST = 2**31 - 1


@functools.cache
def claim_many_limited() -> sa.Select:
    """claim_many_limited: claim_many for a kind with a limit (in code or an operator's
    override), run after flow.lock_limits of :of_kind in the same transaction, so the
    counts it reads are exact. Returns claim_many's columns, and on every row (the
    one row of NULLs too): ``held_rate``, the rows it held for the rate;
    ``window_claims`` / ``window_rate``, the window's count after it and the rate in force
    (NULL without a rate, or when nothing started); ``opened``, this claim opened a new
    rate window.

    The claim is bounded, in this ONE statement, by :n, by what the rate window still
    takes (the claims started are counted in it) and, per concurrency key, by the
    concurrency in force minus that key's running jobs. The first :n rows picked (in
    claim_many's order) are each claimed or, refused by a limit, held: ``limit`` (its
    key is full) or ``rate`` (the window is spent), to be woken as a single claim's
    refused job is (a slot's release, the next window). One more row is picked and left
    as ``next_id``: every row due is thus claimed, held or reached by a wakeup. Held
    rows are not picked again, but for the delivered job (a woken job, a rate window's
    wakeup carried by a held job). ``next_queue``: the queue of the claim (and of
    ``next_id``), also when nothing was claimed."""
    delivered = _delivered(of_kind=True)
    n = sa.bindparam("n", type_=sa.Integer)
    row = limits.alias("lim")
    # Read before this statement counts its claims (one snapshot for the whole statement).
    caps = (
        sa.select(
            in_force_concurrency(row.c).label("cap"),
            sa.func.coalesce(_rate_budget(row), _MOST).label("budget"),
            sa.and_(in_force_rate(row.c).is_not(None), _new_window(row.c)).label("opened"),
        )
        .where(row.c.kind == sa.bindparam("of_kind"))
        .cte("caps")
    )
    held_or_delivered = sa.or_(_c.held.is_(None), _c.id == sa.bindparam("job_id", type_=ID))
    picked = _picked(delivered, n, held_or_delivered, _c.concurrency_key)
    order = _order(picked)
    cap = sa.select(caps.c.cap).scalar_subquery()
    running = running_like(sa.bindparam("of_kind", type_=sa.String), picked.c.concurrency_key)
    free = sa.case((cap.is_(None), _MOST), (cap > running, cap - running), else_=0)
    ranked = sa.select(
        picked.c.id,
        sa.func.row_number().over(order_by=order).label("rank"),
        sa.func.row_number().over(partition_by=picked.c.concurrency_key, order_by=order).label("key_rank"),
        free.label("free"),
    ).cte("ranked")
    # Within its key's free slots, then numbered again: the rate bounds the kind.
    fits = (
        sa.select(ranked.c.id, sa.func.row_number().over(order_by=ranked.c.rank).label("place"))
        .where(ranked.c.rank <= n, ranked.c.key_rank <= ranked.c.free)
        .cte("fits")
    )
    budget = sa.select(caps.c.budget).scalar_subquery()
    taken = sa.select(fits.c.id).where(fits.c.place <= budget)
    cancelled = sa.exists().where(runs.c.id == _c.run_id, runs.c.cancelled_at.is_not(None))
    claimed = (
        sa.update(jobs).where(_c.id.in_(taken)).values(**claimed_values(cancelled)).returning(*CLAIMED_COLUMNS).cte("claimed")
    )
    refused = ranked.c.rank <= n
    reason = sa.case((ranked.c.key_rank > ranked.c.free, Held.LIMIT.value), else_=Held.RATE.value)
    held = (
        sa.update(jobs)
        .where(_c.id == ranked.c.id, refused, _c.id.not_in(taken))
        .values(held=reason, woken_at=db_now())
        .returning(_c.held)
        .cte("held")
    )
    started = sa.select(sa.func.count()).select_from(claimed).where(claimed.c.status == Status.RUNNING.value).scalar_subquery()
    counted = count_rate_claims(started).where(started > 0).cte("counted")
    event, detail = _claim_event(claimed)
    following = sa.select(ranked.c.id).where(ranked.c.rank == n + 1).scalar_subquery()
    paused = sa.exists().where(pauses.c.kind == sa.select(delivered.c.kind).scalar_subquery())
    held_rate = sa.select(sa.func.count()).select_from(held).where(held.c.held == Held.RATE.value).scalar_subquery()
    flags = sa.select(
        paused.label("paused"),
        held_rate.label("held_rate"),
        sa.select(counted.c.rate_claims).scalar_subquery().label("window_claims"),
        sa.select(counted.c.window_rate).scalar_subquery().label("window_rate"),
        sa.func.coalesce(sa.select(caps.c.opened).scalar_subquery(), sa.false()).label("opened"),
        sa.select(delivered.c.queue).scalar_subquery().label("next_queue"),
    ).cte("flags")
    return durable(
        logged(
            sa.select(claimed, following.label("next_id"), flags.c.paused, flags.c.held_rate)
            .add_columns(flags.c.window_claims, flags.c.window_rate, flags.c.opened, flags.c.next_queue)
            .select_from(flags.outerjoin(claimed, sa.true()))
            .add_cte(_events_of(claimed, event, detail, "logged"))
        )
    )


def _delivered(*, of_kind: bool = False) -> sa.CTE:
    """The kind and queue of the delivered job :job_id, whose task must be :wakeup_task
    (a wakeup is untrusted input); ``of_kind``: and whose kind is :of_kind (the kind
    whose limits row the transaction locked)."""
    named = jobs.alias("named")
    guards = [named.c.id == sa.bindparam("job_id", type_=ID), named.c.task == sa.bindparam("wakeup_task", type_=_c.task.type)]
    if of_kind:
        guards.append(named.c.kind == sa.bindparam("of_kind", type_=sa.String))
    return sa.select(named.c.kind, named.c.queue).where(*guards).cte("delivered")


def _picked(
    delivered: sa.CTE, n: Any, held: sa.ColumnElement[bool], *columns: Any, guard: sa.ColumnElement[bool] | None = None
) -> sa.CTE:
    """Up to ``n`` + 1 due pending jobs of the delivered job's kind and queue that
    ``held`` admits, best priority first, then (a fair kind) smallest fair_key, then
    oldest, FOR UPDATE SKIP LOCKED: two many-job claims at once take different rows,
    neither waits. Nothing of a paused kind.

    The kind and queue are values (one probe of the delivered row), compared by equality
    with celery_lease_jobs_due's keys, so the claim walks that index in its order and
    stops after n + 1 rows, however many jobs are pending (a join, or IS NOT DISTINCT
    FROM, sorted every pending job of the kind per claim)."""
    kind = sa.select(delivered.c.kind).scalar_subquery()
    queue = sa.select(sa.func.coalesce(delivered.c.queue, "")).scalar_subquery()
    return (
        sa.select(_c.id, _c.priority, _c.fair_key, _c.created_at, *columns)
        .where(
            _c.kind == kind,
            sa.func.coalesce(_c.queue, "") == queue,
            # (Literal 'pending' and held IS NULL: the index's predicate, which a prepared
            # generic plan can only use when the WHERE visibly implies it.)
            _c.status == _PENDING,
            held,
            _c.task == sa.bindparam("wakeup_task"),
            _due(_c),
            ~sa.exists().where(pauses.c.kind == kind),
            *(() if guard is None else (guard,)),
        )
        # fair_key is NULL for every job of a kind that is not fair (statements/fair.py:
        # a fair kind's many-job claim is a weighted mix of tenants).
        .order_by(_c.priority.desc(), _c.fair_key, _c.created_at)
        .limit(n + 1)
        .with_for_update(of=jobs, skip_locked=True)
        .cte("picked")
        .prefix_with("MATERIALIZED")
    )


def _order(picked: sa.CTE) -> tuple[Any, ...]:
    """_picked's order, to number its rows apart: PostgreSQL takes no window function
    beside FOR UPDATE."""
    return (picked.c.priority.desc(), picked.c.fair_key, picked.c.created_at)


def _claim_event(claimed: sa.CTE) -> tuple[Any, Any]:
    """Each claimed row's run event and its detail: 'claimed' by :owner, or 'cancelled'
    for a job its cancelled run kept from starting."""
    was_cancelled = claimed.c.status == Status.CANCELLED.value
    event = sa.case((was_cancelled, sa.literal(Event.CANCELLED.value)), else_=sa.literal(Event.CLAIMED.value))
    detail = sa.case((was_cancelled, sa.literal(RUN_CANCELLED)), else_=sa.bindparam("owner", type_=sa.Text))
    return event, detail
