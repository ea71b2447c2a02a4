"""The dashboard's statements (celery_lease.ops.dashboard), named like those of
the rest of :mod:`celery_lease.db.statements`, whose time helpers and conventions they share.

Every read is bounded whatever the size of the job table: it walks one index over a
bounded range (newest jobs, recent finishes, the live set) and stops after a fixed
number of rows. None counts the terminal history: those counts are for a recent window
(``terminal_counts``), and the job list scans at most ``scan`` rows per page
(``scan_jobs``), handing back a cursor to search further.

Constants a partial index predicate needs are literal SQL, as in common.py: the
planner can only use a partial index (running, wakeup, held, finished) when the
statement visibly implies its predicate.
"""

from __future__ import annotations

import dataclasses
import functools
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from celery_lease.db.schema import events, history, history_events, jobs, limits
from celery_lease.db.statements.common import db_now, db_now_plus, epoch_seconds, sql_function
from celery_lease.db.statements.flow import rate_window_now
from celery_lease.db.statements.history import everywhere
from celery_lease.db.statements.in_force import in_force_per_seconds, in_force_rate
from celery_lease.status import TERMINAL, Status

_c = jobs.c
_PENDING: sa.ColumnElement[str] = sa.literal_column(f"'{Status.PENDING.value}'")
_RUNNING: sa.ColumnElement[str] = sa.literal_column(f"'{Status.RUNNING.value}'")
#: The finished index's predicate, spelt as schema.py spells it.
_FINISHED = sa.text(f"status IN ({', '.join(repr(s) for s in sorted(s.value for s in TERMINAL))})")
_RETRYABLE = [Status.FAILED.value, Status.EXPIRED.value, Status.CANCELLED.value]

#: What a row of the job list shows.
LIST_COLUMNS = (
    _c.id,
    _c.kind,
    _c.queue,
    _c.status,
    _c.attempt,
    _c.max_attempts,
    _c.tenant,
    _c.run_id,
    _c.held,
    _c.created_at,
    _c.started_at,
    _c.finished_at,
    _c.error,
)


@functools.cache
def serial_reads() -> sa.TextClause:
    """serial_reads (PostgreSQL): no parallel workers for the rest of this transaction.
    The dashboard's reads are small by construction; starting workers costs more than
    they save (the counts of 10,000 live jobs: 23 ms with two workers, 9 ms without,
    on a busy two-core host)."""
    return sa.text("SET LOCAL max_parallel_workers_per_gather = 0")


@dataclasses.dataclass(frozen=True)
class Filter:
    """A validated job filter (celery_lease.ops.dashboard.filters builds it)."""

    status: str | None = None
    kind: str | None = None
    queue: str | None = None
    tenant: str | None = None
    run_id: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    #: A top-level payload field and the text its value must equal.
    field: str | None = None
    value: str | None = None


def _scanned(f: Filter, after: tuple[Any, str] | None, scan: int, columns: tuple = LIST_COLUMNS) -> sa.Subquery:
    """The newest ``scan`` jobs (after the cursor) that the indexed filters allow:
    created time (celery_lease_jobs_created), tenant (celery_lease_jobs_tenant), run
    (celery_lease_jobs_run) and status running (celery_lease_jobs_running). The other
    filters are applied to these rows only, so a page never reads more than ``scan``."""
    stmt = sa.select(*columns)
    if f.tenant is not None:
        stmt = stmt.where(_c.tenant == f.tenant)
    if f.run_id is not None:
        stmt = stmt.where(_c.run_id == f.run_id)
    if f.status == Status.RUNNING.value:
        stmt = stmt.where(_c.status == _RUNNING)
    if f.since is not None:
        stmt = stmt.where(_c.created_at >= f.since)
    if f.until is not None:
        stmt = stmt.where(_c.created_at < f.until)
    if after is not None:
        created_at, job_id = after
        stmt = stmt.where(sa.or_(_c.created_at < created_at, sa.and_(_c.created_at == created_at, _c.id < job_id)))
    return everywhere(stmt.order_by(_c.created_at.desc(), _c.id.desc()).limit(scan)).subquery("scanned")


def scan_jobs(f: Filter, *, after: tuple[Any, str] | None, scan: int, limit: int) -> sa.Select:
    """scan_jobs: a page of jobs matching ``f``, newest first, found among the next
    ``scan`` jobs after the cursor (see _scanned)."""
    s = _scanned(f, after, scan, (*LIST_COLUMNS, _c.payload) if f.field is not None else LIST_COLUMNS)
    stmt = sa.select(*(s.c[c.name] for c in LIST_COLUMNS))
    if f.status is not None and f.status != Status.RUNNING.value:
        stmt = stmt.where(s.c.status == f.status)
    if f.kind is not None:
        stmt = stmt.where(s.c.kind == f.kind)
    if f.queue is not None:
        stmt = stmt.where(s.c.queue == f.queue)
    if f.field is not None:
        stmt = stmt.where(s.c.payload[f.field].as_string() == f.value)
    return stmt.order_by(s.c.created_at.desc(), s.c.id.desc()).limit(limit)


def scan_end(f: Filter, *, after: tuple[Any, str] | None, scan: int) -> sa.Select:
    """scan_end: the (created_at, id) of the last job a scan_jobs window read: where the
    next window starts when the page came back short. No row when the window held
    fewer than ``scan`` jobs (it reached the oldest). Reads index entries only."""
    s = _scanned(f, after, scan, columns=(_c.created_at, _c.id))
    return sa.select(s.c.created_at, s.c.id).offset(scan - 1).limit(1)


def get_job_detail(job_id: str, *, tenant: str | None, cap: int, payloads: bool = False) -> sa.Select:
    """get_job_detail: one job for its page; result (and with ``payloads`` the payload)
    as JSON text cut at ``cap`` characters, with their full lengths, and the
    checkpoint's size only. Without ``payloads`` the payload is not read (NULL)."""

    def text(col):
        return sa.cast(col, sa.Text)

    payload = (sa.func.substr(text(_c.payload), 1, cap), sa.func.length(text(_c.payload))) if payloads else (sa.null(), sa.null())
    stmt = sa.select(
        *(c for c in jobs.c if c.name not in ("payload", "result", "checkpoint", "canvas")),
        payload[0].label("payload_text"),
        payload[1].label("payload_chars"),
        sa.func.substr(text(_c.result), 1, cap).label("result_text"),
        sa.func.length(text(_c.result)).label("result_chars"),
        sa.func.length(text(_c.checkpoint)).label("checkpoint_chars"),
    ).where(_c.id == job_id)
    return everywhere(stmt if tenant is None else stmt.where(_c.tenant == tenant))


def job_events(job_id: str, limit: int) -> sa.Select:
    """job_events: one job's run events, oldest first (celery_lease_events_job)."""
    return everywhere(sa.select(events).where(events.c.job_id == job_id).order_by(events.c.id).limit(limit))


# --- counts (bounded: the live set, flow.flow_counts; recent finishes) ---------


def terminal_counts(tenant: str | None) -> sa.Select:
    """terminal_counts: per (kind, status), jobs finished in the last :window seconds,
    through the finished index."""
    stmt = sa.select(_c.kind, _c.status, sa.func.count().label("n")).where(
        _FINISHED, _c.finished_at >= db_now_plus(-sa.bindparam("window", type_=sa.Float))
    )
    if tenant is not None:
        stmt = stmt.where(_c.tenant == tenant)
    return everywhere(stmt.group_by(_c.kind, _c.status))


# --- live throughput and latency ----------------------------------------------------------


#: The minute (since the Unix epoch) a timestamp falls in, as an integer.
minute_of = sql_function(
    "minute_of",
    sa.BigInteger(),
    "floor(extract(epoch from {}) / 60)::bigint",
    "CAST((julianday({}) - 2440587.5) * 1440.0 AS INTEGER)",
)


def _recent(column, where: Any, tenant: str | None, *columns) -> sa.Subquery:
    """The newest :cap jobs whose ``column`` is within the last :window seconds."""
    stmt = sa.select(*columns).where(where, column >= db_now_plus(-sa.bindparam("window", type_=sa.Float)))
    if tenant is not None:
        stmt = stmt.where(_c.tenant == tenant)
    return everywhere(stmt.order_by(column.desc()).limit(sa.bindparam("cap"))).subquery("recent")


def recent_submits(tenant: str | None) -> sa.Select:
    """recent_submits: per (kind, minute), jobs created in the last :window seconds,
    counting at most the newest :cap (celery_lease_jobs_created)."""
    r = _recent(_c.created_at, sa.true(), tenant, _c.kind, minute_of(_c.created_at).label("minute"))
    return sa.select(r.c.kind, r.c.minute, sa.func.count()).group_by(r.c.kind, r.c.minute)


def recent_finishes(tenant: str | None) -> sa.Select:
    """recent_finishes: the newest :cap jobs finished in the last :window seconds
    (celery_lease_jobs_finished): kind, status, minute, and, for those that started,
    queue wait (submit to the last attempt's start) and run time in seconds."""
    r = _recent(
        _c.finished_at,
        _FINISHED,
        tenant,
        _c.kind,
        _c.status,
        minute_of(_c.finished_at).label("minute"),
        (epoch_seconds(_c.started_at) - epoch_seconds(_c.created_at)).label("wait"),
        (epoch_seconds(_c.finished_at) - epoch_seconds(_c.started_at)).label("run"),
    )
    return sa.select(r.c.kind, r.c.status, r.c.minute, r.c.wait, r.c.run)


@functools.cache
def database_now() -> sa.Select:
    return sa.select(db_now(), minute_of(db_now()))


@functools.cache
def rate_budgets() -> sa.Select:
    """rate_budgets: per rate-limited kind, its rate in force (an operator's override
    included) and the claims its current window has counted (0 when no claim opened
    this window yet)."""
    rate, per = in_force_rate(limits.c), in_force_per_seconds(limits.c)
    current = limits.c.rate_window == rate_window_now(per)
    used = sa.case((current, limits.c.rate_claims), else_=0).label("used")
    return sa.select(limits.c.kind, rate.label("rate"), per.label("per_seconds"), used).where(rate.is_not(None))


# --- workers, leases and reconciliation -----------------------------------------------------


def running_leases(tenant: str | None, limit: int) -> sa.Select:
    """running_leases: running jobs, the soonest lease expiry first (celery_lease_jobs_running)."""
    stmt = sa.select(
        _c.id, _c.kind, _c.lease_owner, _c.lease_expires_at, _c.lease_seconds, _c.attempt, _c.started_at, _c.tenant
    ).where(_c.status == _RUNNING)
    if tenant is not None:
        stmt = stmt.where(_c.tenant == tenant)
    return stmt.order_by(_c.lease_expires_at).limit(limit)


def leases_by_owner(tenant: str | None) -> sa.Select:
    """leases_by_owner: per worker process (lease owner), its running jobs and latest expiry."""
    stmt = sa.select(_c.lease_owner, sa.func.count().label("n"), sa.func.max(_c.lease_expires_at).label("latest")).where(
        _c.status == _RUNNING
    )
    if tenant is not None:
        stmt = stmt.where(_c.tenant == tenant)
    return stmt.group_by(_c.lease_owner).order_by(_c.lease_owner)


def _unswept():
    """Due pending jobs, not held, whose last wakeup is older than :stale_seconds (or
    that have none): what the sweeper re-sends (the wakeup index)."""
    return sa.and_(
        _c.status == _PENDING,
        _c.held.is_(None),
        sa.or_(_c.run_after.is_(None), _c.run_after <= db_now()),
        sa.or_(_c.woken_at.is_(None), _c.woken_at < db_now_plus(-sa.bindparam("stale_seconds", type_=sa.Float))),
    )


def stale_wakeups(tenant: str | None, limit: int) -> sa.Select:
    """stale_wakeups: the oldest-woken of the jobs the sweeper would wake (see _unswept)."""
    stmt = sa.select(_c.id, _c.kind, _c.queue, _c.created_at, _c.woken_at, _c.run_after).where(_unswept())
    if tenant is not None:
        stmt = stmt.where(_c.tenant == tenant)
    return stmt.order_by(_c.woken_at.nulls_first()).limit(limit)


def count_capped(select: sa.Select, cap: int) -> sa.Select:
    """count_capped: how many rows ``select`` gives, reading at most ``cap`` + 1 of them."""
    inner = select.with_only_columns(sa.literal(1).label("one")).order_by(None).limit(cap + 1).subquery("capped")
    return sa.select(sa.func.count()).select_from(inner)


def unswept_jobs(tenant: str | None) -> sa.Select:
    stmt = sa.select(_c.id).where(_unswept())
    return stmt if tenant is None else stmt.where(_c.tenant == tenant)


def pending_by_queue(tenant: str | None) -> sa.CompoundSelect:
    """pending_by_queue: per queue, pending jobs not held (a wakeup is owed) and held
    ones (none is), through the wakeup and held indexes."""
    parts = []
    for held in (False, True):
        where = sa.and_(_c.status == _PENDING, _c.held.is_not(None) if held else _c.held.is_(None))
        part = sa.select(_c.queue, sa.literal(held).label("held"), sa.func.count().label("n")).where(where)
        if tenant is not None:
            part = part.where(_c.tenant == tenant)
        parts.append(part.group_by(_c.queue))
    return sa.union_all(*parts)


def held_groups(tenant: str | None) -> sa.Select:
    """held_groups: per (kind, concurrency key, cause), the pending jobs flow control
    holds (celery_lease_jobs_held), with the oldest one's creation."""
    stmt = sa.select(
        _c.kind, _c.concurrency_key, _c.held, sa.func.count().label("n"), sa.func.min(_c.created_at).label("oldest")
    ).where(_c.status == _PENDING, _c.held.is_not(None))
    if tenant is not None:
        stmt = stmt.where(_c.tenant == tenant)
    return stmt.group_by(_c.kind, _c.concurrency_key, _c.held).order_by(_c.kind, _c.concurrency_key)


def job_states(ids: list[str]) -> sa.Select:
    """job_states: the status of each of these jobs (those that exist)."""
    return everywhere(sa.select(_c.id, _c.status).where(_c.id.in_(ids)))


# --- actions -------------------------------------------------------------------------------


def retry_as_new_job(tenant: str | None, dialect: str) -> Any:
    """retry_as_new_job: a failed, expired or cancelled job, submitted again as a new
    pending job (:new_id) with the same kind, task, queue, payload, limits, tenant and
    run, a fresh attempt budget, and the old job as its parent.

    The old job is terminal and stays as it was ("never resurrect a finished job"); its
    canvas (chain, callbacks, chord) is not carried over: those already fired or were
    dropped when it ended. The new job is woken at once (woken_at: now).

    It starts at the old job's lease_generation, the highest fencing token the old job
    handed out (every revoke bumps it too; a terminal job's never moves again): its
    first claim's token is above all of them. A system that saw the old job's tokens
    accepts the retry's writes, and a stale holder of the old job cannot outbid the
    retry (the same resource, one sequence of tokens).

    A job is retried at most once, so that sequence stays one: :new_id is the one id
    its retry can have (ops/retry.py derives it from the old job's), and a job by that
    id already existing, here or in the history, inserts nothing. Two retries of one
    job would both start at its generation and hand out the same tokens; a second one
    retries the retry, which starts above every token of the first. Racing retries
    (two transactions) meet on the primary key: the second waits for the first and
    then inserts nothing."""
    # trace_context too: the retry's attempts stay in the trace of the original submit.
    copied = (
        "lease_generation",
        "kind",
        "task",
        "queue",
        "max_attempts",
        "lease_seconds",
        "payload",
        "run_id",
        "tenant",
        "priority",
        "trace_context",
    )
    new_id = sa.bindparam("new_id", type_=_c.id.type)
    same = jobs.alias("same_id")  # not correlated with the old job's row
    taken = sa.select(sa.literal(1)).where(same.c.id == new_id).exists()
    source = sa.select(
        new_id,
        *(_c[name] for name in copied),
        _c.concurrency_key,
        sa.literal(Status.PENDING.value),
        sa.literal(0),
        _c.id,
        db_now(),
        db_now(),
        db_now(),
    ).where(_c.id == sa.bindparam("job_id", type_=_c.id.type), _c.status.in_(_RETRYABLE), ~taken)
    if tenant is not None:
        source = source.where(_c.tenant == tenant)
    source = everywhere(source)
    columns = ["id", *copied, "concurrency_key", "status", "attempt", "parent_id", "created_at", "updated_at", "woken_at"]
    insert: Any = (postgresql.insert if dialect == "postgresql" else sqlite.insert)(jobs)
    return (
        insert.from_select(columns, source)
        .on_conflict_do_nothing(index_elements=[_c.id])
        .returning(_c.id, _c.task, _c.queue, _c.run_id, _c.attempt)
    )


def delete_finished_jobs(ids: list[str], tenant: str | None, dialect: str) -> Any:
    """delete_finished_jobs: these jobs, where they are terminal (a pending or running
    job is cancelled first: deleting it would leave its worker or wakeup without a row).
    On PostgreSQL also those in the history, with their events there; returns the ids
    deleted (the caller deletes the events of celery_lease_events)."""

    def deleted(table: sa.Table) -> Any:
        stmt = sa.delete(table).where(table.c.id.in_(ids), table.c.status.in_([s.value for s in TERMINAL]))
        if tenant is not None:
            stmt = stmt.where(table.c.tenant == tenant)
        return stmt.returning(table.c.id)

    if dialect != "postgresql":
        return deleted(jobs)
    hot, old = deleted(jobs).cte("hot"), deleted(history).cte("old")
    old_events = sa.delete(history_events).where(history_events.c.job_id.in_(sa.select(old.c.id))).cte("old_events")
    return sa.union_all(sa.select(hot.c.id), sa.select(old.c.id)).add_cte(old_events)
