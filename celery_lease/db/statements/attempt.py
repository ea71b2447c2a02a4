"""The statements of an attempt's life (celery_lease.worker, celery_lease.lifecycle):
renewing its lease, and its fenced writes (checkpoint, progress, success, failure,
retry, shutdown handoff, snooze), each guarded by the lease generation it claimed."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from celery_lease.db.schema import ID, JSON, jobs
from celery_lease.db.statements.attempt_log import close_attempt
from celery_lease.db.statements.common import (
    ENDED_COLUMNS,
    _c,
    _lease_cleared,
    _running_under_lease,
    _seconds,
    db_now,
    db_now_plus,
)
from celery_lease.db.statements.events import event_rows, events_cte, logged
from celery_lease.db.statements.history import everywhere
from celery_lease.status import AttemptOutcome, Event, Status


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


def _ending(outcome: AttemptOutcome, **values: Any) -> sa.Update:
    """The fenced write that ends an attempt as ``outcome`` (still running under the
    generation it claimed; zero rows: its lease is lost): ``values``, the attempt closed
    in the job's attempt log, the lease cleared."""
    return (
        sa.update(jobs)
        .where(_running_under_lease)
        .values(**values, updated_at=db_now(), attempts=close_attempt(outcome), **_lease_cleared)
        .returning(*ENDED_COLUMNS)
    )


@functools.cache
def complete_job() -> sa.Update:
    """complete_job: running -> succeeded; clears the checkpoint in the same write."""
    return _ending(
        AttemptOutcome.SUCCEEDED,
        status=Status.SUCCEEDED.value,
        result=sa.bindparam("new_result", type_=_c.result.type),
        # the last coalesced ctx.publish() value, if one is still unwritten
        progress=sa.func.coalesce(sa.bindparam("new_progress", type_=_c.progress.type), _c.progress),
        checkpoint=None,
        finished_at=db_now(),
    )


#: The parameter under which a transition of many attempts (complete_jobs,
#: time_out_jobs) carries them: one dict per attempt, each with the keys of its
#: statement's attempt_rows. attempt_params turns them into one array per column.
ROWS = "attempt_list"
#: The parameter of the attempts' ids: a statement that binds it is one of many
#: attempts (db/prepared.py plans it once).
ARRAY_OF_IDS = "attempt_id"


def attempt_params(attempts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """What a many-attempt statement binds: one array per column (``attempt_<column>``),
    the same statement for any number of attempts (prepared once per connection, where
    there was one statement per row count), plus the attempts themselves (ROWS, for
    the run events' details). A JSON column's values travel as JSON text."""
    params: dict[str, Any] = {ROWS: attempts}
    for name in attempts[0] if attempts else ():
        values = [a.get(name) for a in attempts]
        params[f"attempt_{name}"] = [None if v is None else json.dumps(v) for v in values] if name in _JSON_COLUMNS else values
    return params


_JSON_COLUMNS = frozenset({"result", "progress"})


def attempt_rows(dialect: str, **columns: sa.types.TypeEngine) -> sa.FromClause:
    """The attempts bound by attempt_params as a table: ``id``, ``generation`` and
    ``columns``.

    PostgreSQL: ``unnest`` of typed arrays, whose length the planner knows (a custom
    plan: the array's own; a generic plan: 10 rows), so each row is found through the
    primary key. (``jsonb_to_recordset`` of one JSON array is planned as 100 rows, so
    a small hot table was read whole by a hash join.) SQLite: the arrays as JSON,
    joined by position."""
    columns = {"id": ID, "generation": sa.BigInteger(), **columns}
    if dialect == "postgresql":
        arrays = [_array(f"attempt_{n}", t) for n, t in columns.items()]
        return sa.func.unnest(*arrays).table_valued(*(sa.column(n, t) for n, t in columns.items())).render_derived("rows")
    each = {
        n: sa.func.json_each(sa.bindparam(f"attempt_{n}", type_=JSON)).table_valued("key", "value").alias(f"a_{n}")
        for n in columns
    }
    first, *others = each.values()
    joined: sa.FromClause = first
    for table in others:
        joined = joined.join(table, table.c.key == first.c.key)
    field: dict[str, sa.ColumnElement[Any]] = {n: table.c.value for n, table in each.items()}
    # SQLite stores a UUID as its 32 hex digits (sa.Uuid without a native type).
    field["id"] = sa.func.replace(field["id"], "-", "")
    return sa.select(*(sa.type_coerce(f, columns[n]).label(n) for n, f in field.items())).select_from(joined).subquery("rows")


def _array(name: str, t: sa.types.TypeEngine) -> sa.ColumnElement[Any]:
    """An array of ``t`` bound as ``name``: ids and JSON bound as text and cast in SQL
    (the driver sends them as strings, and a PREPAREd parameter takes no implicit
    text -> uuid)."""
    if isinstance(t, (sa.Uuid, sa.JSON)):
        return sa.cast(sa.bindparam(name, type_=postgresql.ARRAY(sa.Text)), postgresql.ARRAY(t))
    return sa.bindparam(name, type_=postgresql.ARRAY(t))


@functools.cache
def complete_jobs() -> sa.Select:
    """complete_jobs: complete_job for many attempts in one statement (PostgreSQL),
    appending the run event of each completed job of a run itself (events.logs_itself).

    The attempts come as attempt_params (id, generation, result, progress); each row
    is fenced exactly like complete_job. Returns the ids completed: an attempt missing
    from the result had lost its lease.
    """
    done = attempt_rows("postgresql", result=_c.result.type, progress=_c.progress.type)
    completed = (
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
            attempts=close_attempt(AttemptOutcome.SUCCEEDED),
            lease_owner=sa.null(),
            lease_expires_at=sa.null(),
        )
        .returning(_c.id, _c.run_id, _c.attempt)  # what the run events need
        .cte("completed")
    )
    succeeded = event_rows(completed, sa.literal(Event.SUCCEEDED.value), sa.null())
    return logged(sa.select(completed.c.id).add_cte(events_cte("completed_logged", succeeded)))


def landed_successes(leases: Iterable[tuple[str, int]]) -> sa.Select:
    """Which of these (job, generation) attempts are recorded as succeeded (a write
    retried after its reply was lost checks what had landed), wherever they live: a
    job may have moved into the history since."""
    landed = sa.and_(sa.tuple_(_c.id, _c.lease_generation).in_(list(leases)), _c.status == Status.SUCCEEDED.value)
    return everywhere(sa.select(_c.id).where(landed))


@functools.cache
def fail_job() -> sa.Update:
    """fail_job: running -> failed with a sanitized error; the checkpoint is kept."""
    return _ending(AttemptOutcome.FAILED, status=Status.FAILED.value, error=sa.bindparam("new_error"), finished_at=db_now())


@functools.cache
def retry_job() -> sa.Update:
    """retry_job: running -> pending, due after the backoff; the sweeper wakes it."""
    return _ending(AttemptOutcome.RETRIED, status=Status.PENDING.value, run_after=db_now_plus(_seconds("delay")), woken_at=None)


@functools.cache
def hand_off_job() -> sa.Update:
    """hand_off_job: running -> pending at once without spending the attempt.

    Used on warm shutdown. woken_at is set because the caller publishes the wakeup
    right after; the checkpoint is kept so the next worker resumes.
    """
    return _ending(
        AttemptOutcome.HANDED_OFF, status=Status.PENDING.value, attempt=_c.attempt - 1, run_after=None, woken_at=db_now()
    )


@functools.cache
def snooze_job() -> sa.Update:
    """snooze_job: running -> pending, due in :delay seconds, without spending the attempt.

    Not a failure: the attempt is given back (as by a shutdown handoff), so a job may
    snooze any number of times whatever its max_attempts; the checkpoint is kept. Due
    at once (:delay 0) it is marked woken, since the caller publishes its wakeup;
    later, the sweeper wakes it when due.
    """
    return _ending(
        AttemptOutcome.SNOOZED,
        status=Status.PENDING.value,
        attempt=_c.attempt - 1,
        run_after=db_now_plus(_seconds("delay")),
        woken_at=sa.case((_seconds("delay") <= 0, db_now()), else_=sa.null()),
        held=sa.null(),
    )


@functools.cache
def time_out_jobs(dialect: str) -> sa.Update:
    """time_out_jobs: attempts past their kind's timeout, in one statement (a worker's
    timeout thread writes every timeout due at once).

    The attempts come as attempt_params (id, generation, delay); each row is fenced
    exactly like retry_job and fail_job: still running under that generation. One with
    attempts left is retried (pending, due after its delay, the sweeper wakes it); one
    on its last attempt fails with :new_error. Returns the rows moved: an attempt
    missing from them had lost its lease.
    """
    due = attempt_rows(dialect, delay=sa.Float())
    last = _c.attempt >= _c.max_attempts

    def retried(value, otherwise):
        return sa.case((last, otherwise), else_=value)

    return (
        sa.update(jobs)
        .where(_c.id == due.c.id, _c.lease_generation == due.c.generation, _c.status == Status.RUNNING.value)
        .values(
            status=retried(sa.literal(Status.PENDING.value), sa.literal(Status.FAILED.value)),
            run_after=retried(db_now_plus(due.c.delay), _c.run_after),
            woken_at=retried(sa.null(), _c.woken_at),
            error=retried(_c.error, sa.bindparam("new_error", type_=_c.error.type)),
            finished_at=retried(_c.finished_at, db_now()),
            updated_at=db_now(),
            attempts=close_attempt(AttemptOutcome.TIMED_OUT),
            **_lease_cleared,
        )
        .returning(*ENDED_COLUMNS)
    )
