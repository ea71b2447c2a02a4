"""The statements of an attempt's life (celery_lease.worker, celery_lease.lifecycle):
renewing its lease, its fenced checkpoint and progress, and the one statement that ends
attempts (end_jobs), each write guarded by the lease generation it claimed."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from celery_lease.db.durability import durable
from celery_lease.db.schema import ID, JSON, jobs
from celery_lease.db.statements.attempt_log import closed
from celery_lease.db.statements.common import (
    ENDED_COLUMNS,
    _c,
    _running_under_lease,
    db_now,
    db_now_plus,
    planned_once,
)
from celery_lease.db.statements.events import event_rows, events_cte, logged
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


#: The parameter under which a statement of many attempts (end_jobs) carries them: one
#: dict per attempt, each with the keys of its statement's attempt_rows. attempt_params
#: turns them into one array per column.
ROWS = "attempt_list"


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


#: What each outcome of an attempt makes of its job (AttemptOutcome values).
_SUCCEEDED = AttemptOutcome.SUCCEEDED.value
_FAILED = AttemptOutcome.FAILED.value
_TIMED_OUT = AttemptOutcome.TIMED_OUT.value
_SNOOZED = AttemptOutcome.SNOOZED.value
_HANDED_OFF = AttemptOutcome.HANDED_OFF.value


@functools.cache
def end_jobs(dialect: str) -> Any:
    """end_jobs: the one statement that ends attempts, any number of them, each as its
    own outcome (River's JobSetStateIfRunning).

    The endings come as attempt_params (id, generation, outcome, result, progress,
    error, delay, detail); each row is fenced: still running under the generation it
    claimed (a row missing from the result had lost its lease). By outcome:

    - succeeded: succeeded with its result; the checkpoint cleared.
    - failed: failed with its error; the checkpoint kept.
    - retried: pending, due after delay; the sweeper wakes it.
    - timed out: retried, or failed with its error on the last attempt.
    - snoozed: pending, due after delay, its attempt given back (woken at once for 0).
    - handed off: pending now, its attempt given back, woken (the caller publishes).

    Every one closes the attempt in the job's log and clears the lease. Returns the
    ended rows (ENDED_COLUMNS, woken_at, error). On PostgreSQL it appends the run
    events of the jobs of a run itself (events.logs_itself).
    """
    e = attempt_rows(
        dialect,
        outcome=sa.Text(),
        result=_c.result.type,
        progress=_c.progress.type,
        error=sa.Text(),
        delay=sa.Float(),
        detail=sa.Text(),
    )
    outcome = e.c.outcome
    succeeds = outcome == sa.literal(_SUCCEEDED)
    fails = sa.or_(outcome == sa.literal(_FAILED), sa.and_(outcome == sa.literal(_TIMED_OUT), _c.attempt >= _c.max_attempts))
    ends = sa.or_(succeeds, fails)
    handed_off = outcome == sa.literal(_HANDED_OFF)
    snoozed = outcome == sa.literal(_SNOOZED)
    now = db_now()
    ended = (
        sa.update(jobs)
        .where(_c.id == e.c.id, _c.lease_generation == e.c.generation, _c.status == sa.literal(Status.RUNNING.value))
        .values(
            # Constants as SQL, not values bound at compile time: prepared, only the
            # rows' values travel with each EXECUTE (prepared._inline_constants).
            status=sa.case(
                (succeeds, sa.literal(Status.SUCCEEDED.value)),
                (fails, sa.literal(Status.FAILED.value)),
                else_=sa.literal(Status.PENDING.value),
            ),
            result=sa.case((succeeds, e.c.result), else_=_c.result),
            # the last coalesced ctx.publish() value, if one is still unwritten
            progress=sa.func.coalesce(e.c.progress, _c.progress),
            checkpoint=sa.case((succeeds, sa.null()), else_=_c.checkpoint),
            error=sa.case((fails, e.c.error), else_=_c.error),
            finished_at=sa.case((ends, now), else_=_c.finished_at),
            attempt=sa.case((sa.or_(snoozed, handed_off), _c.attempt - 1), else_=_c.attempt),
            run_after=sa.case((handed_off, sa.null()), (ends, _c.run_after), else_=db_now_plus(e.c.delay)),
            woken_at=sa.case(
                (handed_off, now),
                (sa.and_(snoozed, e.c.delay <= 0), now),
                (ends, _c.woken_at),
                else_=sa.null(),
            ),
            held=sa.case((snoozed, sa.null()), else_=_c.held),
            attempts=closed(_c.attempts, outcome, now),
            updated_at=now,
            lease_owner=sa.null(),
            lease_expires_at=sa.null(),
        )
    )
    returned = (*ENDED_COLUMNS, _c.woken_at, _c.error)
    if dialect != "postgresql":  # SQLite: RETURNING names the updated table only; the caller logs
        return planned_once(durable(ended.returning(*returned)))
    done = ended.returning(*returned, e.c.outcome, e.c.detail).cte("ended")
    d = done.c
    event = sa.case(
        (d.status == sa.literal(Status.SUCCEEDED.value), sa.literal(Event.SUCCEEDED.value)),
        (d.status == sa.literal(Status.FAILED.value), sa.literal(Event.FAILED.value)),
        (d.outcome.in_([sa.literal(_SNOOZED), sa.literal(_HANDED_OFF)]), sa.literal(Event.REQUEUED.value)),
        else_=sa.literal(Event.RETRIED.value),
    )
    detail = sa.case((d.status == sa.literal(Status.FAILED.value), d.error), else_=d.detail)
    logged_rows = events_cte("ended_logged", event_rows(done, event, detail))
    return planned_once(logged(durable(sa.select(*(d[c.name] for c in returned)).add_cte(logged_rows))))
