"""What the statements of the catalogue share: the database's clock (``db_now``,
``db_now_plus``, ``epoch_seconds``), the guards of a transition (the attempt's lease, a
delivered wakeup, due jobs), the column sets transitions return, and the locked chunk
(``_chunk`` / ``_picked``) by which the beat's statements change a bounded number of rows;
and how their rows are read (``row_dicts``).
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.functions import FunctionElement

from celery_lease.db.schema import ID, jobs, limits
from celery_lease.status import TERMINAL, Status


def row_dicts(result: sa.CursorResult) -> list[dict[str, Any]]:
    """A result's rows as dicts, zipped with its keys read once: a mapping view per row
    costs three times as much, and a reap returns thousands of rows."""
    keys = tuple(result.keys())
    return [dict(zip(keys, row)) for row in result]


#: The execution option of a statement whose prepared form PostgreSQL must plan once per
#: connection (db/prepared.py). Left to choose, PostgreSQL compares the generic plan's
#: estimate with a custom plan's and, for these, plans every EXECUTE anew: an array of
#: unknown length (the endings), a fair-share branch a plain submit never runs. That
#: planning cost more than the statement's work; the generic plan reaches each row by
#: its primary key (or inserts it) all the same.
PLAN_ONCE = "celery_lease_plan_once"


def planned_once(stmt: Any) -> Any:
    """``stmt``, marked to run on PostgreSQL's generic plan when prepared."""
    return stmt.execution_options(**{PLAN_ONCE: True})


def is_planned_once(stmt: Any) -> bool:
    return bool(stmt.get_execution_options().get(PLAN_ONCE, False))


# --- database time -----------------------------------------------------------------


class db_now(FunctionElement):
    """The database's current UTC time."""

    type = sa.DateTime(timezone=True)
    inherit_cache = True


_SQLITE_TS = "'%Y-%m-%d %H:%M:%f'"


def sql_function(name: str, type_: sa.types.TypeEngine, pg_sql: str, sqlite_sql: str) -> type[FunctionElement]:
    """A function of one argument the two databases spell differently: ``pg_sql`` and
    ``sqlite_sql`` are its SQL, ``{}`` standing for the compiled argument."""
    function: type[FunctionElement] = type(name, (FunctionElement,), {"type": type_, "inherit_cache": True})

    def spell(sql: str):
        def compile_(element, compiler, **kw):
            (argument,) = element.clauses
            return sql.format(compiler.process(argument, **kw))

        return compile_

    compiles(function)(spell(pg_sql))
    compiles(function, "sqlite")(spell(sqlite_sql))
    return function


@compiles(db_now)
def _now_default(element, compiler, **kw):
    return "now()"


# SQLite keeps times as text, compared as text. SQLAlchemy writes bound datetimes with
# microseconds ("... 12:00:05.120000"); strftime's %f gives milliseconds ("05.120"), so
# three zeros are appended: both spellings of one instant are then the same string.
@compiles(db_now, "sqlite")
def _now_sqlite(element, compiler, **kw):
    return f"(strftime({_SQLITE_TS}, 'now') || '000')"


#: The database's current time plus a number of seconds (may be negative).
db_now_plus = sql_function(
    "db_now_plus",
    sa.DateTime(timezone=True),
    "(now() + make_interval(secs => {}))",
    f"(strftime({_SQLITE_TS}, 'now', printf('%+.6f seconds', {{}})) || '000')",
)
#: Seconds since the Unix epoch of a timestamp, as a float.
epoch_seconds = sql_function("epoch_seconds", sa.Float(), "extract(epoch from {})", "((julianday({}) - 2440587.5) * 86400.0)")


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


def _chunk(name: str, where: sa.ColumnElement, order_by, limit: str | sa.ColumnElement) -> sa.CTE:
    """A bounded chunk of ids, locked, skipping rows another beat holds; the statement
    joins it by primary key (``UPDATE ... FROM chunk WHERE id = chunk.id``).

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


def _picked(chunk: sa.CTE, dialect: str) -> sa.ColumnElement[bool]:
    """The rows of a locked chunk, for the statement that changes them. PostgreSQL: the
    ids as one array probed by primary key, so no estimate of the chunk (a generic
    plan guesses :limit) can turn the statement into a join that reads the table.
    SQLite: one writer at a time, no planner joins to fear."""
    if dialect == "postgresql":
        return _c.id == sa.any_(sa.cast(sa.select(sa.func.array_agg(chunk.c.id)).scalar_subquery(), postgresql.ARRAY(ID)))
    return _c.id.in_(sa.select(chunk.c.id))


#: What a requeue (reap, restart recovery) returns: the wakeup, the run event, an ended
#: job's canvas (its errbacks), and what FlowControl.release needs (RELEASE_COLUMNS),
#: so the caller frees slots without reading the jobs again.
REQUEUED_COLUMNS = (
    *ENDED_COLUMNS,
    RELEASE_COLUMNS[-1],
)
