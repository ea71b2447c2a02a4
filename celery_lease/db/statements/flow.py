"""The flow-control statements (run by :mod:`celery_lease.flow.store`): the limits
row, the pause row, holding a refused job, waking held jobs, the rate window, the view.

The claims themselves (a limited kind's included) are the claim family of
:mod:`celery_lease.db.statements.claim`; the guards it shares with these (the running
count of a kind and key, whether a rate window takes a claim) are here.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.functions import FunctionElement

from celery_lease.db.schema import jobs, limits, pauses
from celery_lease.db.statements.common import (
    _PENDING,
    WAKEUP_COLUMNS,
    _c,
    _chunk,
    _delivered,
    _due,
    _picked,
    _seconds,
    db_now,
    db_now_plus,
    epoch_seconds,
)
from celery_lease.db.statements.in_force import (
    below_concurrency,
    in_force_concurrency,
    in_force_per_seconds,
    in_force_rate,
    overridden,
    running_like,
)
from celery_lease.status import Held, Status


class rate_window_now(FunctionElement):
    """The index of the current rate window: epoch seconds of the database clock
    divided by a window's length, rounded down."""

    type = sa.BigInteger()
    inherit_cache = True


def _window_parts(element, compiler, **kw) -> tuple[str, str]:
    """The database clock in epoch seconds (as epoch_seconds spells it), and the length."""
    (per,) = element.clauses
    return compiler.process(epoch_seconds(db_now()), **kw), compiler.process(per, **kw)


@compiles(rate_window_now)
def _rate_window_default(element, compiler, **kw):
    epoch, per = _window_parts(element, compiler, **kw)
    return f"CAST(floor({epoch} / {per}) AS BIGINT)"


@compiles(rate_window_now, "sqlite")
def _rate_window_sqlite(element, compiler, **kw):
    epoch, per = _window_parts(element, compiler, **kw)
    # Epoch seconds are positive: truncation is rounding down (SQLite may lack floor()).
    return f"CAST({epoch} / {per} AS INTEGER)"


#: Seconds: a database clock this far behind the start of the stored rate window has
#: stepped back (NTP, a failover to another host). Far more than any claim's lock wait
#: (pooled connections have a lock_timeout): a claim whose transaction began a moment
#: before the stored window is a lock wait across the boundary, not a step back.
STEP_BACK_SECONDS = 60


def _new_window(row) -> sa.ColumnElement[bool]:
    """The database clock is past the stored rate window, or stepped back behind it:
    the current window is a new one (its count starts again). Without the step back, a
    clock set back an hour froze a rate-limited kind for an hour."""
    per = in_force_per_seconds(row)
    now = rate_window_now(per)
    stepped_back = epoch_seconds(db_now()) < row.rate_window * per - STEP_BACK_SECONDS
    return sa.or_(now > row.rate_window, stepped_back)


def _rate_open(row) -> sa.ColumnElement:
    """A limits row's rate window still takes a claim. A claim whose transaction began
    in an older window than the one stored (it waited for the lock across the
    boundary) is refused, so no window, however its claims are grouped (by the window
    that counted them or by their started_at), holds more than the rate."""
    now, rate = rate_window_now(in_force_per_seconds(row)), in_force_rate(row)
    return sa.case(
        (rate.is_(None), sa.true()),
        (_new_window(row), sa.true()),
        (now == row.rate_window, row.rate_claims < rate),
        else_=sa.false(),
    )


def _rate_open_for(kind) -> sa.ScalarSelect:
    row = limits.alias("lim")
    return sa.select(_rate_open(row.c)).where(row.c.kind == kind).scalar_subquery()


@functools.cache
def count_rate_claim() -> sa.Update:
    """count_rate_claim: one more claim in the kind's current rate window (a new window
    starts at 1), when a rate is in force. Returns the count (1 means this claim opened
    the window) and ``window_rate``, the rate in force."""
    return count_rate_claims(1)


def count_rate_claims(count) -> sa.Update:
    """``count`` more claims (an int, or a column expression: a many-job claim's rows) in
    the kind's current rate window, as count_rate_claim counts one."""
    now = rate_window_now(in_force_per_seconds(limits.c))
    return (
        sa.update(limits)
        .where(limits.c.kind == sa.bindparam("of_kind"), in_force_rate(limits.c).is_not(None))
        .values(
            rate_window=now,
            rate_claims=sa.case((_new_window(limits.c), count), else_=limits.c.rate_claims + count),
        )
        .returning(limits.c.rate_claims, in_force_rate(limits.c).label("window_rate"))
    )


@functools.cache
def hold_job() -> sa.Update:
    """hold_job: a delivery flow control refused leaves its job pending, marked with
    why: 'pause' (its kind is paused), and for a :limited kind 'rate' (its rate
    window is spent) or 'limit' (as many jobs of its kind and key run as its
    concurrency in force allows). held NULL
    in the result means nothing holds it now: the caller claims again. Run under the
    kind's limits row lock (after lock_limits_row) for a limited kind, so the reason is
    decided on the same state a release sees.

    The pause row is read FOR SHARE: a resume that deletes it either waits for this
    statement (and then wakes the job it marked) or commits first (and this statement
    sees no pause). woken_at records when the job was held, so the sweeper's recovery
    of missed wakeups (stale_held_groups) leaves freshly held jobs alone.
    """
    paused = sa.exists(sa.select(pauses.c.kind).where(pauses.c.kind == _c.kind).with_for_update(read=True))
    limited = sa.bindparam("limited", type_=sa.Boolean)
    full = sa.not_(below_concurrency(_c.kind, _c.concurrency_key))
    reason = sa.case(
        (paused, Held.PAUSE.value),
        (sa.and_(limited, sa.not_(sa.func.coalesce(_rate_open_for(_c.kind), sa.true()))), Held.RATE.value),
        (sa.and_(limited, full), Held.LIMIT.value),
        else_=None,
    )
    return (
        sa.update(jobs)
        .where(_delivered())  # as claim_job's: an untrusted wakeup for another task writes nothing
        .values(held=reason, woken_at=db_now())
        .returning(_c.held, *WAKEUP_COLUMNS)
    )


@functools.cache
def hold_paused() -> sa.Update:
    """hold_paused: after a claim of a paused kind that claims many jobs per delivery
    (worker/many_claim.py) took nothing, the other due pending jobs of the delivered job's
    kind and queue are held for the pause too, as hold_job holds the delivered one: their
    wakeups were coalesced into its (broker/waking.py), so the resume must find them held. The
    pause row is read FOR SHARE, as there."""
    named = jobs.alias("named")
    of_delivered = named.c.id == sa.bindparam("job_id"), named.c.task == sa.bindparam("wakeup_task")
    paused = sa.exists(sa.select(pauses.c.kind).where(pauses.c.kind == _c.kind).with_for_update(read=True))
    return (
        sa.update(jobs)
        .where(
            _c.kind == sa.select(named.c.kind).where(*of_delivered).scalar_subquery(),
            _c.queue.is_not_distinct_from(sa.select(named.c.queue).where(*of_delivered).scalar_subquery()),
            _c.status == _PENDING,
            _c.held.is_(None),
            _due(_c),
            paused,
        )
        .values(held=Held.PAUSE.value, woken_at=db_now())
        .returning(_c.id)
    )


@functools.cache
def get_claim_target() -> sa.Select:
    """What a delivery that claimed nothing names: the job's kind, key, status, held
    reason, wakeup (task, queue) and ``wait``: seconds until it is due, by the database
    clock (NULL when due)."""
    wait = sa.case((_c.run_after > db_now(), epoch_seconds(_c.run_after) - epoch_seconds(db_now())), else_=sa.null())
    return sa.select(*WAKEUP_COLUMNS, _c.kind, _c.concurrency_key, _c.status, _c.held, wait.label("wait")).where(
        _c.id == sa.bindparam("job_id")
    )


@functools.cache
def lock_limits(dialect: str) -> sa.Insert:
    """lock_limits: create or update a kind's limits row with the limits its worker
    declares, locking it until the transaction ends. Every limited claim and every
    release of a limited kind's slot takes this lock first, so they serialize per kind."""
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    stmt = insert(limits).values(
        kind=sa.bindparam("of_kind"),
        concurrency=sa.bindparam("new_concurrency"),
        rate=sa.bindparam("new_rate"),
        per_seconds=sa.bindparam("new_per_seconds"),
        updated_at=db_now(),
    )
    # A new window length ("5/s" redeployed as "300/m"): the stored window numbers
    # count windows of the old length; re-based to the new one (the window that holds
    # the same instant), so a window's claims still count, and the next window's wakeup
    # may be scheduled again. (Kept as they were, every claim was refused for good.)
    old, new = limits.c.per_seconds, stmt.excluded.per_seconds
    # (Only while the declared length is the one in force: an operator's rate override
    # sets its own, and the declared one changing then resizes nothing.)
    resized = sa.and_(limits.c.per_seconds_override.is_(None), old.is_not(None), new.is_not(None), old != new)

    def rebased(window: sa.ColumnElement) -> sa.ColumnElement:
        return sa.case((resized, (window * old) // new), else_=window)

    return stmt.on_conflict_do_update(
        index_elements=[limits.c.kind],
        set_={
            "concurrency": stmt.excluded.concurrency,
            "rate": stmt.excluded.rate,
            "per_seconds": new,
            "rate_window": rebased(limits.c.rate_window),
            "woken_window": sa.case((resized, 0), else_=limits.c.woken_window),
            "updated_at": db_now(),
        },
    )


def _rate_budget(row) -> sa.ColumnElement:
    """The claims the rate window of a limits row (``row``: the table or an alias)
    still takes; NULL without a rate."""
    now, rate = rate_window_now(in_force_per_seconds(row.c)), in_force_rate(row.c)
    return sa.case(
        (rate.is_(None), sa.null()),
        (_new_window(row.c), rate),
        (sa.and_(now == row.c.rate_window, rate > row.c.rate_claims), rate - row.c.rate_claims),
        else_=0,
    )


@functools.cache
def lock_limits_row() -> sa.Select:
    """A kind's limits row, locked (a release of a slot: the limits stay as declared),
    with the claims its rate window still takes (NULL without a rate)."""
    budget = _rate_budget(limits)
    return sa.select(limits, budget.label("rate_budget")).where(limits.c.kind == sa.bindparam("of_kind")).with_for_update()


@functools.cache
def schedule_window_wakeup() -> sa.Update:
    """Record that a wakeup is sent for the start of the kind's next rate window;
    returns the seconds until then, or no row when one is already scheduled (one
    wakeup per window and kind)."""
    per = in_force_per_seconds(limits.c)
    now = rate_window_now(per)
    following = sa.case((_new_window(limits.c), now), else_=limits.c.rate_window) + 1
    return (
        sa.update(limits)
        # (woken_window != following, not <: after the clock stepped back, the window
        # recorded lies ahead of the next one, and must not block its wakeup.)
        .where(
            limits.c.kind == sa.bindparam("of_kind"),
            in_force_rate(limits.c).is_not(None),
            limits.c.woken_window != following,
        )
        .values(woken_window=following)
        .returning((following * per - epoch_seconds(db_now())).label("seconds"))
    )


@functools.cache
def await_window() -> sa.Update:
    """await_window: the job that carries a rate window's wakeup (:job_id, or with
    :job_id NULL the first due job of :of_kind still held for the rate) is due only at
    the window's start, :seconds from now by the database clock. A wakeup that a
    host's clock delivers early then finds it not due yet, and is sent again for the
    time left (FlowControl.claim), instead of being spent on a refused claim."""
    first = (
        sa.select(_c.id)
        .where(_c.status == _PENDING, *_held_for(Held.RATE, by_key=False))
        .order_by(_c.priority.desc(), _c.created_at)
        .limit(1)
        .scalar_subquery()
    )
    target = sa.func.coalesce(sa.bindparam("job_id", type_=_c.id.type), first)
    return (
        sa.update(jobs)
        .where(_c.id == target, _c.status == Status.PENDING.value, _c.held == Held.RATE.value)
        .values(run_after=db_now_plus(_seconds("seconds")))
        .returning(*WAKEUP_COLUMNS)
    )


def _wake(where: list[sa.ColumnElement], limit: sa.ColumnElement, dialect: str) -> sa.Update:
    """Up to ``limit`` held jobs matching ``where``, best priority first, then oldest:
    no longer held, woken now. Returns what their wakeups need.

    The jobs are picked by common._chunk (a MATERIALIZED CTE, locked, skipping rows
    another wake holds) and changed by primary key (common._picked). As an ``id IN
    (SELECT ... LIMIT ... FOR UPDATE SKIP LOCKED)`` subquery the planner may rescan the
    pick once per outer row, each rescan skipping the rows just woken and taking more:
    one freed slot of a ``concurrency=1`` kind woke all 200 of its held jobs."""
    picked = _chunk("woken", sa.and_(_c.status == _PENDING, *where), (_c.priority.desc(), _c.created_at), limit)
    return _woken(_picked(picked, dialect))


def _woken(picked: sa.ColumnElement[bool]) -> sa.Update:
    """The pending jobs ``picked`` no longer held, woken now; what their wakeups need."""
    return (
        sa.update(jobs)
        .where(picked, _c.status == Status.PENDING.value)
        .values(held=sa.null(), woken_at=db_now(), run_after=sa.null())
        .returning(*WAKEUP_COLUMNS)
    )


def _held_for(reason: Held, *, by_key: bool) -> list[sa.ColumnElement]:
    """Jobs of :of_kind held for ``reason`` (with ``by_key``, of concurrency key :key).
    The reason is literal SQL: a generic plan then uses the held index too. (A job is
    held only when due; one that carries a rate window's wakeup is due only at the
    window's start (await_window), but a wake that picks it sends it now.)"""
    where = [_c.held == sa.literal_column(f"'{reason.value}'"), _c.kind == sa.bindparam("of_kind")]
    if by_key:
        where.append(_c.concurrency_key.is_not_distinct_from(sa.bindparam("key", type_=sa.String)))
    return where


@functools.cache
def wake_for_slot(dialect: str) -> sa.Update:
    """wake_for_slot: after a limited job left running, the jobs of its kind and key
    :key held by the limit, as many as slots are free now (the kind's concurrency in
    force minus its running jobs of that key; all of them when none is in force), best
    priority first. Run after lock_limits_row in the same transaction."""
    row, most = limits.alias("lim"), sa.literal(2**31 - 1)
    running = running_like(sa.bindparam("of_kind"), sa.bindparam("key", type_=sa.String))
    cap = in_force_concurrency(row.c)
    free = (
        sa.select(sa.case((cap.is_(None), most), (cap > running, cap - running), else_=0))
        .where(row.c.kind == sa.bindparam("of_kind"))
        .scalar_subquery()
    )
    return _wake(_held_for(Held.LIMIT, by_key=True), sa.func.coalesce(free, 0), dialect)


@functools.cache
def top_up(dialect: str) -> sa.Update:
    """top_up, after lock_limits_row in its transaction (the one statement under the
    lock): wake the jobs of :of_kind held by its limit (key :key) up to its free slots
    and its rate budget, then those held for its rate up to the budget left. A
    limit not in force bounds nothing; no limits row, nothing is woken."""
    row, most = limits.alias("lim"), sa.literal(2**31 - 1)
    running = running_like(sa.bindparam("of_kind"), sa.bindparam("key", type_=sa.String))
    limit = in_force_concurrency(row.c)
    free = sa.case((limit.is_(None), most), (limit > running, limit - running), else_=0)
    budget = sa.func.coalesce(_rate_budget(row), most)
    cap = sa.select(free.label("free"), budget.label("budget")).where(row.c.kind == sa.bindparam("of_kind")).cte("capacity")
    order = (_c.priority.desc(), _c.created_at)
    slots = sa.select(sa.case((cap.c.free < cap.c.budget, cap.c.free), else_=cap.c.budget)).scalar_subquery()
    by_limit = _chunk("woken_limit", sa.and_(_c.status == _PENDING, *_held_for(Held.LIMIT, by_key=True)), order, slots)
    left = cap.c.budget - sa.select(sa.func.count()).select_from(by_limit).scalar_subquery()
    rest = sa.select(sa.case((left > 0, left), else_=0)).scalar_subquery()
    by_rate = _chunk("woken_rate", sa.and_(_c.status == _PENDING, *_held_for(Held.RATE, by_key=False)), order, rest)
    woken = sa.or_(_picked(by_limit, dialect), _picked(by_rate, dialect))
    return _woken(woken)


@functools.cache
def wake_held(reason: Held, dialect: str) -> sa.Update:
    """wake_held: up to :limit jobs of :of_kind held for ``reason``, best priority first."""
    return _wake(_held_for(reason, by_key=False), sa.bindparam("limit", type_=sa.Integer), dialect)


def limited_kinds(kinds: Sequence[str]) -> sa.Select:
    """Which of these kinds have a limits row (their ended jobs may free a slot)."""
    return sa.select(limits.c.kind).where(limits.c.kind.in_(kinds))


@functools.cache
def stale_held_groups() -> sa.Select:
    """(kind, key, held) groups with a job held longer than :stale_seconds: where a
    wakeup may have been missed (a worker died between freeing a slot and waking the
    next job, a window wakeup was lost). Bounded by :limit."""
    return (
        sa.select(_c.kind, _c.concurrency_key, _c.held)
        .distinct()
        .where(
            _c.status == _PENDING,
            _c.held.is_not(None),
            _c.woken_at < db_now_plus(-_seconds("stale_seconds")),
        )
        .limit(sa.bindparam("limit"))
    )


@functools.cache
def list_limits() -> sa.Select:
    return sa.select(limits).order_by(limits.c.kind)


def flow_counts(tenant: str | None = None) -> sa.Select:
    """Per (kind, concurrency key, status, held): active jobs, for the limits view.

    Active jobs are read through the three partial indexes that hold exactly them
    (running; pending and held; pending and not held), one part each, so the cost
    follows the live jobs, never the terminal history (a scan of 300k rows otherwise,
    for any tenant's token: issue 19)."""
    parts = [
        _c.status == Status.RUNNING.value,
        sa.and_(_c.status == Status.PENDING.value, _c.held.is_not(None)),
        sa.and_(_c.status == Status.PENDING.value, _c.held.is_(None)),
    ]
    selects = []
    for where in parts:
        part = sa.select(_c.kind, _c.concurrency_key, _c.status, _c.held).where(where)
        selects.append(part if tenant is None else part.where(_c.tenant == tenant))
    active = sa.union_all(*selects).subquery("active")
    keys = (active.c.kind, active.c.concurrency_key, active.c.status, active.c.held)
    return sa.select(*keys, sa.func.count()).group_by(*keys)


# The pause row (celery_lease_pauses): a row pauses its kind; no claim of it succeeds
# until resume deletes it. The claim and hold_job read it; these write and list it.
@functools.cache
def pause_kind(dialect: str) -> sa.Insert:
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    return (
        insert(pauses)
        .values(kind=sa.bindparam("of_kind"), paused_at=db_now())
        .on_conflict_do_nothing(index_elements=[pauses.c.kind])
    )


@functools.cache
def resume_kind() -> sa.Delete:
    return sa.delete(pauses).where(pauses.c.kind == sa.bindparam("of_kind"))


@functools.cache
def is_paused() -> sa.Select:
    return sa.select(pauses.c.kind).where(pauses.c.kind == sa.bindparam("of_kind"))


@functools.cache
def list_pauses() -> sa.Select:
    return sa.select(pauses).order_by(pauses.c.kind)


# An operator's override of a kind's limits (the ``*_override`` columns of
# celery_lease_limits; see db/schema.py for their encoding). Every statement that enforces
# a limit reads the limit in force (db/statements/in_force.py); these write the override
# and tell which kinds it limits.
@functools.cache
def override_limits(dialect: str) -> sa.Insert:
    """override_limits: set an operator's override of :of_kind's concurrency (when
    :set_concurrency) and rate (when :set_rate), creating its limits row if none exists
    (a kind that declares no limit in code). The other stays as it was.

    When the rate window length in force changes, the window starts again (its count
    at 0): the stored window numbers count windows of the old length. At most one
    window's worth of claims more may then start at the change."""
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    set_c, set_r = sa.bindparam("set_concurrency", type_=sa.Boolean), sa.bindparam("set_rate", type_=sa.Boolean)

    def given(flag: sa.BindParameter, name: str) -> sa.ColumnElement:
        # (Cast: PostgreSQL types a CASE of NULL parameters as text.)
        return sa.case((flag, sa.cast(sa.bindparam(name, type_=sa.Integer), sa.Integer)), else_=sa.null())

    stmt = insert(limits).values(
        kind=sa.bindparam("of_kind"),
        concurrency_override=given(set_c, "concurrency_override"),
        rate_override=given(set_r, "rate_override"),
        per_seconds_override=given(set_r, "per_seconds_override"),
        updated_at=db_now(),
    )
    new, old = stmt.excluded, limits.c
    rate = sa.case((set_r, new.rate_override), else_=old.rate_override)
    per = sa.case((set_r, new.per_seconds_override), else_=old.per_seconds_override)
    resized = in_force_per_seconds(old).is_distinct_from(sa.func.coalesce(per, old.per_seconds))
    return stmt.on_conflict_do_update(
        index_elements=[limits.c.kind],
        set_={
            "concurrency_override": sa.case((set_c, new.concurrency_override), else_=old.concurrency_override),
            "rate_override": rate,
            "per_seconds_override": per,
            "rate_window": sa.case((resized, 0), else_=old.rate_window),
            "rate_claims": sa.case((resized, 0), else_=old.rate_claims),
            "woken_window": sa.case((resized, 0), else_=old.woken_window),
            "updated_at": db_now(),
        },
    )


@functools.cache
def overridden_kinds() -> sa.Select:
    """The kinds an operator's override limits (a concurrency or a rate of N >= 1):
    their claims take the limited path even when the code declares no limit."""
    return sa.select(limits.c.kind).where(overridden(limits.c))


@functools.cache
def kind_exists() -> sa.Select:
    """Whether :of_kind has any row: a job (of any status), a limits row or a pause."""
    return sa.select(
        sa.or_(
            sa.exists().where(limits.c.kind == sa.bindparam("of_kind")),
            sa.exists().where(pauses.c.kind == sa.bindparam("of_kind")),
            sa.exists().where(jobs.c.kind == sa.bindparam("of_kind")),
        )
    )


@functools.cache
def held_keys() -> sa.Select:
    """The concurrency keys of :of_kind's jobs held by its limit or its rate (read
    through the held index): what a changed limit may now let run."""
    return (
        sa.select(_c.concurrency_key)
        .distinct()
        .where(
            _c.status == _PENDING,
            _c.held.in_([Held.LIMIT.value, Held.RATE.value]),
            _c.kind == sa.bindparam("of_kind"),
        )
    )
