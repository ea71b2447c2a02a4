"""Every SQL statement celery-lease runs, each named after what it does.

Statements are SQLAlchemy Core constructs with bound parameters; statuses come from
:class:`Status`. Each state transition is exactly one guarded statement:

* writes of an attempt (progress, checkpoint, success, failure, retry, handoff) match
  ``id``, ``status = 'running'`` and the ``lease_generation`` the attempt claimed;
  zero rows means the lease is lost and the caller discards the write;
* revoking statements (cancel, reap, recovery) bump ``lease_generation``, so any
  attempt still running holds a stale token from that moment on; like the claims,
  they are marked durable (celery_lease.db.durability);
* nothing ever matches a terminal status, so a finished job never changes again.

Statements with no arguments are built once (``functools.cache``): a construct is
immutable, and building one costs more Python time than running it on a warm
connection.

Time is the database's clock (``now()`` on PostgreSQL), so lease expiry does not
depend on the clocks of the worker and beat hosts agreeing.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.dml import ReturningDelete
from sqlalchemy.sql.functions import FunctionElement

from celery_lease.db.durability import durable
from celery_lease.db.schema import ID, chords, events, jobs, limits, runs
from celery_lease.status import TERMINAL, Event, Status

# --- database time -----------------------------------------------------------------


class db_now(FunctionElement):
    """The database's current UTC time."""

    type = sa.DateTime(timezone=True)
    inherit_cache = True


class db_now_plus(FunctionElement):
    """The database's current time plus a number of seconds (may be negative)."""

    type = sa.DateTime(timezone=True)
    inherit_cache = True


_SQLITE_TS = "'%Y-%m-%d %H:%M:%f'"


@compiles(db_now)
def _now_default(element, compiler, **kw):
    return "now()"


# SQLite keeps times as text, compared as text. SQLAlchemy writes bound datetimes with
# microseconds ("... 12:00:05.120000"); strftime's %f gives milliseconds ("05.120"), so
# three zeros are appended: both spellings of one instant are then the same string.
@compiles(db_now, "sqlite")
def _now_sqlite(element, compiler, **kw):
    return f"(strftime({_SQLITE_TS}, 'now') || '000')"


@compiles(db_now_plus)
def _now_plus_default(element, compiler, **kw):
    (seconds,) = element.clauses
    return f"(now() + make_interval(secs => {compiler.process(seconds, **kw)}))"


@compiles(db_now_plus, "sqlite")
def _now_plus_sqlite(element, compiler, **kw):
    (seconds,) = element.clauses
    return f"(strftime({_SQLITE_TS}, 'now', printf('%+.6f seconds', {compiler.process(seconds, **kw)})) || '000')"


def _seconds(name: str) -> sa.BindParameter:
    return sa.bindparam(name, type_=sa.Float)


# --- guards --------------------------------------------------------------------------

_c = jobs.c
_TERMINAL = [s.value for s in TERMINAL]
_ACTIVE = [Status.PENDING.value, Status.RUNNING.value]
_running_under_lease = sa.and_(
    _c.id == sa.bindparam("job_id"),
    _c.status == Status.RUNNING.value,
    _c.lease_generation == sa.bindparam("generation"),
)
_lease_cleared = {"lease_owner": None, "lease_expires_at": None}


def _due(t) -> sa.ColumnElement:
    """A pending job of table ``t`` may be claimed now (no run_after, or it passed)."""
    return sa.or_(t.run_after.is_(None), t.run_after <= db_now())


def _delivered(job_id: Any = None) -> sa.ColumnElement[bool]:
    """The job a wakeup names (:job_id, or ``job_id``: the claim's target), pending and
    due. Guarded by the job's own task too: a wakeup is untrusted input, and a message
    for kind B's task carrying kind A's job id must match nothing (it would run B's
    handler on A's payload)."""
    return sa.and_(
        _c.id == (sa.bindparam("job_id") if job_id is None else job_id),
        _c.task == sa.bindparam("wakeup_task", type_=_c.task.type),
        _c.status == Status.PENDING.value,
        _due(_c),
    )


# Constants a partial index predicate needs are literal SQL, not bound values: a
# prepared statement's generic plan can only use a partial index (running, wakeup,
# priority, held) when its WHERE visibly implies the index's predicate.
_PENDING: sa.ColumnElement[str] = sa.literal_column(f"'{Status.PENDING.value}'")
_RUNNING: sa.ColumnElement[str] = sa.literal_column(f"'{Status.RUNNING.value}'")

#: What is needed to (re)publish a job's wakeup.
WAKEUP_COLUMNS = (_c.id, _c.task, _c.queue)
#: What a transition that moves a job out of running or pending returns: the wakeup, the
#: run event, an ended job's canvas (its errbacks) and its flow-control group
#: (celery_lease/lifecycle).
ENDED_COLUMNS = (
    _c.id,
    _c.status,
    _c.run_id,
    _c.attempt,
    _c.task,
    _c.queue,
    _c.tenant,
    _c.canvas,
    _c.kind,
    _c.concurrency_key,
)
#: What FlowControl.release needs of a job that left running (or pending): its kind,
#: its concurrency key, and ``limited``: its kind has a limits row (only those can
#: hold jobs for a free slot). A statement that ends jobs returns these.
RELEASE_COLUMNS = (_c.kind, _c.concurrency_key, _c.kind.in_(sa.select(limits.c.kind)).label("limited"))


# --- producer ------------------------------------------------------------------------


#: The columns a submit binds; the database fills created_at / updated_at, and
#: run_after / woken_at from the bound due_at / due_in (see insert_jobs).
INSERTED_COLUMNS = tuple(c.name for c in jobs.c if c.name not in ("created_at", "updated_at", "run_after", "woken_at")) + (
    "due_at",
    "due_in",
)


@functools.cache
def insert_jobs(dialect: str, *, on_key_conflict_nothing: bool) -> sa.Insert:
    """insert_jobs: new pending rows; values are bound per row by the caller.

    With an idempotency key, a conflicting (kind, key) inserts nothing; the caller
    then reads the existing job with ``get_jobs_by_keys``. A row whose id exists
    inserts nothing either: ids are fresh UUIDs, so that row is this very submit,
    landed by an earlier try whose reply was lost (``get_jobs_by_ids`` reads it).
    """
    stmt: Any
    if dialect == "postgresql":
        stmt = postgresql.insert(jobs)
    elif dialect == "sqlite":
        stmt = sqlite.insert(jobs)
    else:  # pragma: no cover - Store refuses other dialects
        raise AssertionError(dialect)
    if on_key_conflict_nothing:
        stmt = stmt.on_conflict_do_nothing()  # on the key or on the id
    else:
        stmt = stmt.on_conflict_do_nothing(index_elements=[_c.id])
    # Every time comes from the database clock: a submitting host whose clock is off
    # must not move a job's due time or hide a lost wakeup (woken_at). A delay
    # (:due_in seconds) is counted from the database's now; an absolute :due_at is the
    # caller's own instant and is kept. A job due at once is woken by submit itself.
    due_at = sa.bindparam("due_at", type_=_c.run_after.type)
    due_in = sa.bindparam("due_in", type_=sa.Float)
    return stmt.values(
        created_at=db_now(),
        updated_at=db_now(),
        run_after=sa.case((due_in.is_not(None), db_now_plus(due_in)), else_=due_at),
        woken_at=sa.case((sa.and_(due_in.is_(None), due_at.is_(None)), db_now()), else_=sa.null()),
    ).returning(*jobs.c)


#: What one submit_many binds once for all its jobs (insert_job_batch).
BATCH_SHARED_COLUMNS = (
    "kind",
    "task",
    "queue",
    "status",
    "attempt",
    "max_attempts",
    "lease_seconds",
    "lease_generation",
    "lease_losses",
    "run_id",
    "parent_id",
    "tenant",
    "canvas",
    "priority",
    "held",
    "trace_context",
)
#: What differs from job to job of one submit_many: the fields of each record of :jobs.
BATCH_JOB_FIELDS = ("id", "payload", "idempotency_key", "concurrency_key")


@functools.cache
def insert_job_batch(*, on_key_conflict_nothing: bool) -> sa.Select:
    """insert_job_batch: new pending jobs of one submit, and the ``dispatched`` event of
    each that belongs to a run, in one statement (PostgreSQL).

    ``:jobs`` is one JSON array of records (``BATCH_JOB_FIELDS``; a missing field is
    NULL), read by json_to_recordset: one parameter whatever the batch size, payloads
    parsed once by the database, never escaped twice. Every other column is one value
    for the batch (``BATCH_SHARED_COLUMNS``). Times are insert_jobs': the database
    clock, from ``:due_at`` / ``:due_in``.

    Conflicts are insert_jobs': a row whose id exists inserts nothing (an earlier try
    of this very submit landed before its reply was lost); with keys, a conflicting
    (kind, key) inserts nothing either. Such rows are missing from what it returns
    (id, created_at, run_after of each row inserted) and have no new event.
    """
    per_job = (
        sa.func.json_to_recordset(sa.cast(sa.bindparam("jobs", type_=sa.Text), postgresql.JSON))
        .table_valued(
            sa.column("id", ID),
            sa.column("payload", postgresql.JSONB),
            sa.column("idempotency_key", _c.idempotency_key.type),
            sa.column("concurrency_key", _c.concurrency_key.type),
        )
        .render_derived(name="batch", with_types=True)
    )
    due_at = sa.cast(sa.bindparam("due_at", type_=_c.run_after.type), _c.run_after.type)
    due_in = sa.cast(sa.bindparam("due_in", type_=sa.Float), sa.Float)
    values: dict[str, Any] = {name: per_job.c[name] for name in BATCH_JOB_FIELDS}
    for name in BATCH_SHARED_COLUMNS:
        values[name] = sa.cast(sa.bindparam(name, type_=_c[name].type), _c[name].type)
    values.update(
        created_at=db_now(),
        updated_at=db_now(),
        run_after=sa.case((due_in.is_not(None), db_now_plus(due_in)), else_=due_at),
        woken_at=sa.case((sa.and_(due_in.is_(None), due_at.is_(None)), db_now()), else_=sa.null()),
    )
    insert = postgresql.insert(jobs).from_select(list(values), sa.select(*values.values()))
    if on_key_conflict_nothing:
        insert = insert.on_conflict_do_nothing()  # on the key or on the id
    else:
        insert = insert.on_conflict_do_nothing(index_elements=[_c.id])
    inserted = insert.returning(_c.id, _c.run_id, _c.attempt, _c.created_at, _c.run_after).cte("inserted")
    dispatched = _events_of(inserted, sa.literal(Event.DISPATCHED.value), sa.null(), "dispatched")
    return sa.select(inserted.c.id, inserted.c.created_at, inserted.c.run_after).add_cte(dispatched)


def get_jobs_by_keys(kind: str, keys: Sequence[str]) -> sa.Select:
    return sa.select(jobs).where(_c.kind == kind, _c.idempotency_key.in_(keys))


def get_jobs_by_ids(ids: Sequence[str]) -> sa.Select:
    return sa.select(jobs).where(_c.id.in_(ids))


def pending_wakeups(ids: Sequence[str]) -> sa.Select:
    """What publishing a wakeup needs (the job's own task and queue), for pending jobs."""
    return sa.select(*WAKEUP_COLUMNS).where(_c.id.in_(ids), _c.status == Status.PENDING.value)


def mark_not_woken(ids: Sequence[str]) -> sa.Update:
    """mark_not_woken: a wakeup could not be published; the sweeper sends it next tick."""
    return sa.update(jobs).where(_c.id.in_(ids), _c.status == Status.PENDING.value).values(woken_at=None)


def upsert_run(dialect: str, run_id: str) -> sa.Insert:
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    return insert(runs).values(id=run_id, created_at=db_now()).on_conflict_do_nothing(index_elements=[runs.c.id])


def get_run(run_id: str) -> sa.Select:
    return sa.select(runs).where(runs.c.id == run_id)


# --- reads ---------------------------------------------------------------------------


def get_job(job_id: str) -> sa.Select:
    return sa.select(jobs).where(_c.id == job_id)


#: What the HTTP API shows of a job: never the payload, checkpoint or lease internals,
#: which may be megabytes (and the lease owner names a worker host).
VIEW_COLUMNS = (
    _c.id,
    _c.kind,
    _c.status,
    _c.result,
    _c.error,
    _c.progress,
    _c.attempt,
    _c.max_attempts,
    _c.created_at,
    _c.started_at,
    _c.finished_at,
    _c.run_id,
    _c.parent_id,
)


def get_job_view(job_id: str, *, tenant: str | None = None) -> sa.Select:
    """get_job_view: one job's API columns; with ``tenant``, only that tenant's job.

    The tenant is in the WHERE clause: another tenant's job reads no more than a
    missing one (one primary-key probe, none of its large columns)."""
    stmt = sa.select(*VIEW_COLUMNS).where(_c.id == job_id)
    return stmt if tenant is None else stmt.where(_c.tenant == tenant)


class json_bytes(FunctionElement):
    """The size in bytes of a JSON column's stored text (NULL for NULL)."""

    type = sa.Integer()
    inherit_cache = True


@compiles(json_bytes)
def _json_bytes_default(element, compiler, **kw):
    (value,) = element.clauses
    return f"octet_length(CAST({compiler.process(value, **kw)} AS TEXT))"


@compiles(json_bytes, "sqlite")
def _json_bytes_sqlite(element, compiler, **kw):
    (value,) = element.clauses
    return f"length(CAST({compiler.process(value, **kw)} AS BLOB))"


def _bounded(column: Any, max_bytes: int) -> tuple[Any, Any]:
    """``column`` when its JSON text is at most ``max_bytes`` (else NULL), and its size:
    a list page never reads a large value out of the table."""
    size = json_bytes(column)
    return sa.case((size <= max_bytes, column), else_=sa.null()).label(column.name), size.label(f"{column.name}_bytes")


def list_job_summaries(*, max_value_bytes: int, **filters: Any) -> sa.Select:
    """list_job_summaries: list_jobs with the API columns, ``result`` and ``progress``
    only when their JSON text is at most ``max_value_bytes`` (NULL otherwise), and
    their sizes (``result_bytes``, ``progress_bytes``)."""
    result, result_bytes = _bounded(_c.result, max_value_bytes)
    progress, progress_bytes = _bounded(_c.progress, max_value_bytes)
    columns = [c for c in VIEW_COLUMNS if c.name not in ("result", "progress")]
    return list_jobs(columns=(*columns, result, result_bytes, progress, progress_bytes), **filters)


def run_visible(run_id: str, *, tenant: str | None = None) -> sa.Select:
    """run_visible: 1 when the run holds a job (of ``tenant``, when given)."""
    stmt = sa.select(sa.literal(1)).where(_c.run_id == run_id)
    if tenant is not None:
        stmt = stmt.where(_c.tenant == tenant)
    return stmt.limit(1)


def list_jobs(
    *,
    status: str | None = None,
    kind: str | None = None,
    tenant: str | None = None,
    run_id: str | None = None,
    after: tuple[Any, str] | None = None,
    limit: int = 50,
    columns: Sequence[Any] = (jobs,),
) -> sa.Select:
    """Newest first; ``after`` is the (created_at, id) of the last row of a page.

    Keyset pagination on (created_at, id) is stable under concurrent inserts: new
    rows sort before the cursor and never shift later pages. A tenant's pages walk
    the ``celery_lease_jobs_tenant`` index (tenant, created_at, id).
    """
    stmt = sa.select(*columns)
    if status is not None:
        stmt = stmt.where(_c.status == status)
    if kind is not None:
        stmt = stmt.where(_c.kind == kind)
    if tenant is not None:
        stmt = stmt.where(_c.tenant == tenant)
    if run_id is not None:
        stmt = stmt.where(_c.run_id == run_id)
    if after is not None:
        created_at, job_id = after
        # On SQLite this compares text: db_now() spells times as bound datetimes do.
        stmt = stmt.where(sa.or_(_c.created_at < created_at, sa.and_(_c.created_at == created_at, _c.id < job_id)))
    return stmt.order_by(_c.created_at.desc(), _c.id.desc()).limit(limit)


def _tenant_jobs_of_run(run_id: str, tenant: str) -> sa.Select:
    return sa.select(_c.id).where(_c.run_id == run_id, _c.tenant == tenant)


def list_run_events(run_id: str, *, after_id: int = 0, limit: int = 1000, tenant: str | None = None) -> sa.Select:
    """A run's events in order; with ``tenant``, only events of that tenant's jobs."""
    stmt = sa.select(events).where(events.c.run_id == run_id, events.c.id > after_id)
    if tenant is not None:
        stmt = stmt.where(events.c.job_id.in_(_tenant_jobs_of_run(run_id, tenant)))
    return stmt.order_by(events.c.id).limit(limit)


def list_tenant_run_events(run_id: str, tenant: str, *, after_seq: int = 0, limit: int = 1000) -> sa.Select:
    """list_tenant_run_events: the events of one tenant's jobs of a run, numbered 1, 2, 3
    ... (``seq``) in order among themselves.

    Event ids come from one sequence for every tenant, so the gaps between a tenant's
    own ids would count everyone else's events: a tenant pages by ``seq`` instead.
    (Pruning a run's old jobs deletes their events and renumbers the later ones.)
    """
    visible = (
        sa.select(events, sa.func.row_number().over(order_by=events.c.id).label("seq"))
        .where(events.c.run_id == run_id, events.c.job_id.in_(_tenant_jobs_of_run(run_id, tenant)))
        .subquery("visible")
    )
    return sa.select(visible).where(visible.c.seq > after_seq).order_by(visible.c.seq).limit(limit)


# --- metrics (read at scrape time) -----------------------------------------------------


class epoch_seconds(FunctionElement):
    """Seconds since the Unix epoch of a timestamp, as a float."""

    type = sa.Float()
    inherit_cache = True


@compiles(epoch_seconds)
def _epoch_default(element, compiler, **kw):
    (ts,) = element.clauses
    return f"extract(epoch from {compiler.process(ts, **kw)})"


@compiles(epoch_seconds, "sqlite")
def _epoch_sqlite(element, compiler, **kw):
    (ts,) = element.clauses
    return f"((julianday({compiler.process(ts, **kw)}) - 2440587.5) * 86400.0)"


@functools.cache
def job_totals() -> sa.Select:
    """Per (status, kind): jobs, attempts claimed, leases lost (reaped or interrupted)."""
    return sa.select(_c.status, _c.kind, sa.func.count(), sa.func.sum(_c.attempt), sa.func.sum(_c.lease_losses)).group_by(
        _c.status, _c.kind
    )


@functools.cache
def event_totals() -> sa.Select:
    """Per (event, detail prefix): rows of the run event logs. The detail tells a
    requeue by restart recovery ("interrupted by restart: ...") from a shutdown handoff."""
    restart = events.c.detail.startswith("interrupted by restart")
    return sa.select(events.c.event, restart.label("restart"), sa.func.count()).group_by(events.c.event, restart)


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


# --- the lease life (worker) ---------------------------------------------------------


def renew_leases(dialect: str, leases: Iterable[tuple[str, int]]) -> sa.Select | sa.Update:
    """renew_leases: one statement for every lease a worker process holds.

    Returns (id, lease_generation, renewed) of each lease still held; a lease missing
    from it is lost. On PostgreSQL a row locked by another transaction is skipped, not
    waited for, and comes back with renewed = false: held (as of the statement's
    snapshot) but not renewed this round. The lock is typically this process's own
    success transaction running a slow ``ctx.effect``; waiting for it would hold up the
    renewal of every other lease of the process until their leases lapsed. (A lock
    held by a cancel or a reap is seen at the next round, once it committed.)
    """
    keys = list(leases)
    held = sa.and_(sa.tuple_(_c.id, _c.lease_generation).in_(keys), _c.status == Status.RUNNING.value)
    renew = {"lease_expires_at": db_now_plus(_c.lease_seconds), "updated_at": db_now()}
    if dialect != "postgresql":  # SQLite: no row locks, every held lease is renewed
        renewed_all = sa.literal(True).label("renewed")
        return sa.update(jobs).where(held).values(**renew).returning(_c.id, _c.lease_generation, renewed_all)
    locked = sa.select(_c.id).where(held).with_for_update(skip_locked=True).cte("renewable").prefix_with("MATERIALIZED")
    renewed = sa.update(jobs).where(_c.id == locked.c.id).values(**renew).returning(_c.id).cte("renewed")
    return (
        sa.select(_c.id, _c.lease_generation, renewed.c.id.is_not(None).label("renewed"))
        .select_from(jobs.outerjoin(renewed, renewed.c.id == _c.id))
        .where(held)
    )


@functools.cache
def save_checkpoint() -> sa.Update:
    return sa.update(jobs).where(_running_under_lease).values(checkpoint=sa.bindparam("new_checkpoint"), updated_at=db_now())


@functools.cache
def publish_progress() -> sa.Update:
    return sa.update(jobs).where(_running_under_lease).values(progress=sa.bindparam("new_progress"), updated_at=db_now())


@functools.cache
def complete_job() -> sa.Update:
    """complete_job: running -> succeeded; clears the checkpoint in the same write."""
    return (
        sa.update(jobs)
        .where(_running_under_lease)
        .values(
            status=Status.SUCCEEDED.value,
            result=sa.bindparam("new_result", type_=_c.result.type),
            # the last coalesced ctx.publish() value, if one is still unwritten
            progress=sa.func.coalesce(sa.bindparam("new_progress", type_=_c.progress.type), _c.progress),
            checkpoint=None,
            finished_at=db_now(),
            updated_at=db_now(),
            **_lease_cleared,
        )
        .returning(*ENDED_COLUMNS)
    )


@functools.cache
def complete_jobs(count: int) -> sa.Update:
    """complete_jobs: complete_job for ``count`` attempts in one statement (PostgreSQL).

    Rows come as a derived table of bound job_id_N, generation_N, new_result_N,
    new_progress_N; each row is fenced exactly like complete_job. Returns the ids
    completed: an attempt missing from the result had lost its lease.
    """
    rows = [
        sa.select(
            sa.cast(sa.bindparam(f"job_id_{i}", type_=sa.Text), ID).label("id"),
            sa.bindparam(f"generation_{i}", type_=sa.BigInteger).label("generation"),
            sa.bindparam(f"new_result_{i}", type_=_c.result.type).label("result"),
            sa.bindparam(f"new_progress_{i}", type_=_c.progress.type).label("progress"),
        )
        for i in range(count)
    ]
    done = (rows[0] if count == 1 else sa.union_all(*rows)).subquery("done")
    return (
        sa.update(jobs)
        .where(
            _c.id == done.c.id,
            _c.lease_generation == done.c.generation,
            _c.status == Status.RUNNING.value,
        )
        .values(
            # Constants as SQL, not values bound at compile time: prepared, only the
            # rows' values travel with each EXECUTE (prepared._inline_constants).
            status=sa.literal(Status.SUCCEEDED.value),
            result=done.c.result,
            progress=sa.func.coalesce(done.c.progress, _c.progress),
            checkpoint=sa.null(),
            finished_at=db_now(),
            updated_at=db_now(),
            lease_owner=sa.null(),
            lease_expires_at=sa.null(),
        )
        .returning(_c.id)
    )


def landed_successes(leases: Iterable[tuple[str, int]]) -> sa.Select:
    """Which of these (job, generation) attempts are recorded as succeeded (a write
    retried after its reply was lost checks what had landed)."""
    return sa.select(_c.id).where(sa.tuple_(_c.id, _c.lease_generation).in_(list(leases)), _c.status == Status.SUCCEEDED.value)


@functools.cache
def fail_job() -> sa.Update:
    """fail_job: running -> failed with a sanitized error; the checkpoint is kept."""
    return (
        sa.update(jobs)
        .where(_running_under_lease)
        .values(
            status=Status.FAILED.value,
            error=sa.bindparam("new_error"),
            finished_at=db_now(),
            updated_at=db_now(),
            **_lease_cleared,
        )
        .returning(*ENDED_COLUMNS)
    )


@functools.cache
def retry_job() -> sa.Update:
    """retry_job: running -> pending, due after the backoff; the sweeper wakes it."""
    return (
        sa.update(jobs)
        .where(_running_under_lease)
        .values(
            status=Status.PENDING.value,
            run_after=db_now_plus(_seconds("delay")),
            woken_at=None,
            updated_at=db_now(),
            **_lease_cleared,
        )
        .returning(*ENDED_COLUMNS)
    )


@functools.cache
def hand_off_job() -> sa.Update:
    """hand_off_job: running -> pending at once without spending the attempt.

    Used on warm shutdown. woken_at is set because the caller publishes the wakeup
    right after; the checkpoint is kept so the next worker resumes.
    """
    return (
        sa.update(jobs)
        .where(_running_under_lease)
        .values(
            status=Status.PENDING.value,
            attempt=_c.attempt - 1,
            run_after=None,
            woken_at=db_now(),
            updated_at=db_now(),
            **_lease_cleared,
        )
        .returning(*ENDED_COLUMNS)
    )


@functools.cache
def snooze_job() -> sa.Update:
    """snooze_job: running -> pending, due in :delay seconds, without spending the attempt.

    Not a failure: the attempt is given back (as by a shutdown handoff), so a job may
    snooze any number of times whatever its max_attempts; the checkpoint is kept. Due
    at once (:delay 0) it is marked woken, since the caller publishes its wakeup;
    later, the sweeper wakes it when due.
    """
    return (
        sa.update(jobs)
        .where(_running_under_lease)
        .values(
            status=Status.PENDING.value,
            attempt=_c.attempt - 1,
            run_after=db_now_plus(_seconds("delay")),
            woken_at=sa.case((_seconds("delay") <= 0, db_now()), else_=sa.null()),
            held=sa.null(),
            updated_at=db_now(),
            **_lease_cleared,
        )
        .returning(*ENDED_COLUMNS)
    )


# --- revoking statements (producer, beat, worker start) -------------------------------


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
            **_lease_cleared,
        )
        .returning(*REQUEUED_COLUMNS)
    )


@functools.cache
def cancel_run() -> sa.Update:
    return sa.update(runs).where(runs.c.id == sa.bindparam("run_id"), runs.c.cancelled_at.is_(None)).values(cancelled_at=db_now())


def _requeue_or(final: Status) -> dict[str, Any]:
    """Values that send a running job back to pending, or to ``final`` when its
    attempts are spent. Bumps the generation: the old attempt is fenced out."""
    out_of_attempts = _c.attempt >= _c.max_attempts
    return {
        "status": sa.case((out_of_attempts, final.value), else_=Status.PENDING.value),
        "lease_generation": _c.lease_generation + 1,
        "lease_losses": _c.lease_losses + 1,
        "run_after": None,
        "woken_at": sa.case((out_of_attempts, None), else_=db_now()),
        "finished_at": sa.case((out_of_attempts, db_now()), else_=None),
        "updated_at": db_now(),
        **_lease_cleared,
    }


def _batch(name: str, where: sa.ColumnElement, order_by, limit: str | sa.ColumnElement) -> sa.CTE:
    """A bounded batch of ids, locked, skipping rows another beat holds; the statement
    joins it by primary key (``UPDATE ... FROM batch WHERE id = batch.id``).

    A MATERIALIZED CTE is computed once per statement. As an ``id IN (SELECT ... LIMIT
    ... FOR UPDATE SKIP LOCKED)`` subquery the planner could rescan it once per outer
    row (statistics taken while few leases were expired make it pick a nested loop),
    each rescan skipping the rows the statement had just updated and locking more: one
    statement then took every matching row (20,000 expired leases: one 49 s statement,
    quadratic). Joined by key, the statement touches at most ``:limit`` rows and costs
    one index probe per row, whatever the backlog and the statistics.
    """
    return (
        sa.select(_c.id)
        .where(where)
        .order_by(*order_by if isinstance(order_by, tuple) else (order_by,))
        .limit(sa.bindparam(limit, type_=sa.Integer) if isinstance(limit, str) else limit)
        .with_for_update(skip_locked=True)
        .cte(name)
        .prefix_with("MATERIALIZED")
    )


_lease_elapsed = sa.and_(_c.status == _RUNNING, _c.lease_expires_at < db_now())


def _picked(batch: sa.CTE, dialect: str) -> sa.ColumnElement[bool]:
    """The rows of a locked batch, for the statement that changes them. PostgreSQL: the
    ids as one array probed by primary key, so no estimate of the batch (a generic
    plan guesses :limit) can turn the statement into a join that reads the table.
    SQLite: one writer at a time, no planner joins to fear."""
    if dialect == "postgresql":
        return _c.id == sa.any_(sa.cast(sa.select(sa.func.array_agg(batch.c.id)).scalar_subquery(), postgresql.ARRAY(ID)))
    return _c.id.in_(sa.select(batch.c.id))


#: What a requeue (reap, restart recovery) returns: the wakeup, the run event, an ended
#: job's canvas (its errbacks), and what FlowControl.release needs (RELEASE_COLUMNS),
#: so the caller frees slots without reading the jobs again.
REQUEUED_COLUMNS = (
    *ENDED_COLUMNS,
    RELEASE_COLUMNS[-1],
)


#: The run event detail of a reaped job is this, ": ", and its new status.
LEASE_EXPIRED = "lease expired"


@functools.cache
def reap_expired(dialect: str) -> sa.Update:
    """reap_expired: running jobs whose lease elapsed -> pending, or expired when their
    attempts are spent. Bounded by :limit; safe with several beats (SKIP LOCKED)."""
    values = _requeue_or(Status.EXPIRED)
    values["error"] = sa.case((_c.attempt >= _c.max_attempts, sa.literal(LEASE_EXPIRED)), else_=_c.error)
    batch = _batch("expired", _lease_elapsed, _c.lease_expires_at, "limit")
    # Locked by this statement: still running and expired.
    return durable(sa.update(jobs).where(_picked(batch, dialect)).values(**values).returning(*REQUEUED_COLUMNS))


@functools.cache
def reap_expired_logged() -> sa.Select:
    """reap_expired, plus the run's 'reaped' event of each reaped job that belongs to a
    run, as ONE statement (PostgreSQL data-modifying CTE): the store runs it prepared,
    in one round trip and its own transaction, and no event row is built in Python.
    The events are those Store.log_events would append (detail "lease expired: <status>")."""
    reaped = reap_expired("postgresql").cte("reaped")
    logged = _events_of(reaped, sa.literal(Event.REAPED.value), sa.literal(f"{LEASE_EXPIRED}: ") + reaped.c.status, "logged")
    return durable(sa.select(reaped).add_cte(logged))


def recover_restarted(owner_prefix: str, owner_boot: str) -> sa.Update:
    """recover_restarted: jobs left running by an earlier boot of this worker node.

    ``owner_prefix`` is "node/" and ``owner_boot`` is "/boot": rows owned by this node
    under another boot id were interrupted by the restart. (Literal values, not bind
    names: LIKE escaping of a node name that contains % or _ needs the string.)
    """
    where = sa.and_(
        _c.status == Status.RUNNING.value,
        _c.lease_owner.startswith(owner_prefix, autoescape=True),
        sa.not_(_c.lease_owner.endswith(owner_boot, autoescape=True)),
    )
    values = _requeue_or(Status.FAILED)
    values["error"] = sa.case((_c.attempt >= _c.max_attempts, sa.literal("interrupted by restart")), else_=_c.error)
    return durable(sa.update(jobs).where(where).values(**values).returning(*REQUEUED_COLUMNS))


def _count(batch: sa.CTE) -> sa.ScalarSelect:
    return sa.select(sa.func.count()).select_from(batch).scalar_subquery()


@functools.cache
def claim_due_wakeups(dialect: str) -> sa.Update:
    """claim_due_wakeups: due pending jobs with no wakeup since :stale_seconds, at most :limit.

    Stamps woken_at before the caller publishes, so two beats never both send the
    same batch, and a crash after this statement only delays the wakeup by one
    threshold.

    Due means pending, not held (flow control wakes held jobs when their cause ends:
    celery_lease.flow), run_after null or past, and woken_at null or older than :stale_seconds.
    That is three disjoint ranges of celery_lease_jobs_wakeup (woken_at, run_after),
    read in index order, each bounded by what is left of :limit: never woken and due
    at once; never woken and run_after past; woken before the threshold (run_after is
    then null or past but for rare rows, filtered). So a tick reads the rows it sends
    plus a few index pages, however many pending jobs were woken recently (each of them
    waits for its claim, not for the sweeper) or are delayed into the future.

    The status and held tests are literal SQL, the partial index's own predicate, so a
    generic plan uses the index too; the UPDATE probes the ids by primary key (_picked).
    """
    pending = sa.and_(_c.status == _PENDING, _c.held.is_(None))
    order = (_c.woken_at, _c.run_after)  # the index's order: a probe stops at :limit rows
    limit = sa.bindparam("limit", type_=sa.Integer)
    never = _batch("never_woken", sa.and_(pending, _c.woken_at.is_(None), _c.run_after.is_(None)), order, limit)
    came_due = _batch("came_due", sa.and_(pending, _c.woken_at.is_(None), _c.run_after <= db_now()), order, limit - _count(never))
    stale = sa.and_(pending, _c.woken_at < db_now_plus(-_seconds("stale_seconds")), _due(_c))
    rewake = _batch("stale", stale, order, limit - _count(never) - _count(came_due))
    due = sa.union_all(*(sa.select(b.c.id) for b in (never, came_due, rewake))).cte("due")
    # Locked by this statement: still pending and due.
    return sa.update(jobs).where(_picked(due, dialect)).values(woken_at=db_now()).returning(*WAKEUP_COLUMNS)


@functools.cache
def prune_jobs(dialect: str) -> ReturningDelete:
    """prune_jobs: a bounded batch of terminal jobs finished before :cutoff_seconds ago.

    Returns the ids deleted; the caller deletes their events in the same transaction.
    """
    old = sa.and_(_c.status.in_(_TERMINAL), _c.finished_at < db_now_plus(-_seconds("cutoff_seconds")))
    batch = _batch("prunable", old, _c.finished_at, "limit")
    # PostgreSQL: DELETE ... USING batch (joined by key). SQLite has no USING; it has
    # no planner rescans either (and no row locks), so IN the batch is the same there.
    where = _c.id == batch.c.id if dialect == "postgresql" else _c.id.in_(sa.select(batch.c.id))
    return sa.delete(jobs).where(where).returning(_c.id)


def delete_job_events(ids: Sequence[str]) -> sa.Delete:
    return sa.delete(events).where(events.c.job_id.in_(ids))


# --- the run event log ---------------------------------------------------------------


def _events_of(source: sa.CTE, event: sa.ColumnElement, detail: sa.ColumnElement, name: str) -> sa.CTE:
    """The CTE ``name`` that appends, in the statement whose CTE ``source`` changed jobs,
    one run event per changed job that belongs to a run (its run_id, id and attempt):
    how a PostgreSQL statement writes its own events, the rows Store.log_events builds."""
    rows = sa.select(source.c.run_id, source.c.id, event, source.c.attempt, detail, db_now()).where(source.c.run_id.is_not(None))
    columns = ["run_id", "job_id", "event", "attempt", "detail", "created_at"]
    return sa.insert(events).from_select(columns, rows).cte(name)


@functools.cache
def append_events() -> sa.Insert:
    """append_events: rows of (run_id, job_id, event, attempt, detail)."""
    return sa.insert(events).values(created_at=db_now())


def event_row(run_id: str, job_id: str, event: Event, attempt: int, detail: str | None = None):
    return {"run_id": run_id, "job_id": job_id, "event": event.value, "attempt": attempt, "detail": detail}


# --- canvas (celery_lease/canvas.py) ---------------------------------------------------


def insert_chord(dialect: str) -> sa.Insert:
    """insert_chord: a chord's counter, before its header jobs exist. A second insert of
    the same group (the client re-applying a frozen chord) changes nothing."""
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    return (
        insert(chords)
        .values(
            id=sa.bindparam("group_id"),
            remaining=sa.bindparam("remaining"),
            members=sa.bindparam("members", type_=chords.c.members.type),
            body=sa.bindparam("body", type_=chords.c.body.type),
            created_at=db_now(),
        )
        .on_conflict_do_nothing(index_elements=[chords.c.id])
    )


@functools.cache
def count_down_chord() -> sa.Update:
    """count_down_chord: one header job succeeded. Runs in that job's success transaction;
    on PostgreSQL the row lock orders concurrent members, so exactly one sees 0."""
    return (
        sa.update(chords)
        .where(chords.c.id == sa.bindparam("group_id"), chords.c.remaining > 0)
        .values(remaining=chords.c.remaining - 1)
        .returning(chords.c.remaining, chords.c.members, chords.c.body)
    )


@functools.cache
def delete_chord() -> Any:
    """delete_chord: the body was created, or a header job failed (its errbacks fire once)."""
    return sa.delete(chords).where(chords.c.id == sa.bindparam("group_id")).returning(chords.c.body)


@functools.cache
def prune_chords(dialect: str) -> ReturningDelete:
    """prune_chords: a bounded batch of chord counters created before :cutoff_seconds ago
    none of whose header jobs is pending or running: their body can no longer be
    created. (A header job that ends otherwise than by success removes its counter in
    that transaction; these are left by a header whose jobs were never written, or gone.)
    Returns the ids deleted."""
    if dialect == "postgresql":
        member = sa.func.jsonb_array_elements_text(chords.c.members).table_valued("value").alias("member")
        member_id: sa.ColumnElement = sa.cast(member.c.value, ID)
    else:  # SQLite stores a UUID as 32 hex digits
        member = sa.func.json_each(chords.c.members).table_valued("value").alias("member")
        member_id = sa.func.replace(member.c.value, "-", "")
    live = sa.select(sa.literal(1)).select_from(member).join(jobs, _c.id == member_id).where(_c.status.in_(_ACTIVE))
    old = sa.and_(chords.c.created_at < db_now_plus(-_seconds("cutoff_seconds")), ~live.exists())
    batch = (
        sa.select(chords.c.id)
        .where(old)
        .order_by(chords.c.created_at)
        .limit(sa.bindparam("limit"))
        .with_for_update(skip_locked=True)  # a member's success transaction holds its chord
        .cte("orphaned")
        .prefix_with("MATERIALIZED")
    )
    where = chords.c.id == batch.c.id if dialect == "postgresql" else chords.c.id.in_(sa.select(batch.c.id))
    return sa.delete(chords).where(where).returning(chords.c.id)


def job_results(ids: Sequence[str]) -> sa.Select:
    return sa.select(_c.id, _c.result).where(_c.id.in_(ids))


@functools.cache
def make_due() -> sa.Update:
    """make_due: a pending job may be claimed now (eager mode runs retries at once)."""
    return sa.update(jobs).where(_c.id == sa.bindparam("job_id"), _c.status == Status.PENDING.value).values(run_after=None)


# --- a transaction's fate after a lost reply (celery_lease/db/landing.py) -------------


@functools.cache
def transaction_mark(lock_timeout: bool) -> sa.Select:
    """The current transaction's id (as text: an xid8) and its server process, taken
    before COMMIT so a lost reply can be settled by asking the server; with
    ``lock_timeout``, also ``SET LOCAL lock_timeout = :lock_timeout_ms`` in the same
    round trip (background transitions never wait on a row lock for long)."""
    columns: list[Any] = [sa.cast(sa.func.pg_current_xact_id(), sa.Text), sa.func.pg_backend_pid()]
    if lock_timeout:
        columns.append(sa.func.set_config("lock_timeout", sa.cast(sa.bindparam("lock_timeout_ms"), sa.Text), True))
    return sa.select(*columns)


@functools.cache
def transaction_status() -> sa.TextClause:
    """'committed', 'aborted' or 'in progress' of transaction :xid (NULL: too old to know)."""
    return sa.text("SELECT pg_xact_status(CAST(:xid AS xid8))")


@functools.cache
def end_stranded_transaction() -> sa.TextClause:
    """Terminate server process :pid if it still runs transaction :xid (its client lost
    the connection before COMMIT was sent or answered, and the server has not noticed):
    the transaction then aborts, so its fate is known. A role may end its own sessions."""
    return sa.text(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
        " WHERE pid = :pid AND backend_xid IS NOT NULL AND backend_xid::text = :xid32"
    )
