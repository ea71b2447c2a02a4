"""Finished jobs past the hot table (PostgreSQL; see db/schema.py, "finished jobs past
the hot table"): the move of a chunk of finished jobs and their run events into the
day-partitioned history, the partitions' own DDL, and ``everywhere``, which turns a
read of celery_lease_jobs / celery_lease_events into a read of every job / event
wherever it lives.
"""

from __future__ import annotations

import datetime as dt
import functools
import re
from typing import Any, TypeVar, cast

import sqlalchemy as sa
from sqlalchemy.sql import visitors

from celery_lease.db.schema import events, events_all, history, history_events, jobs, jobs_all
from celery_lease.db.statements.common import _TERMINAL, _c, _chunk, _picked, _seconds, db_now_plus

_VIEWS = {jobs: jobs_all, events: events_all}

S = TypeVar("S")


def everywhere(stmt: S) -> S:
    """``stmt`` (a read: no FOR UPDATE, no write) over every job and event: each use of
    celery_lease_jobs / celery_lease_events and their columns becomes the view of the
    same columns (celery_lease_jobs_all / celery_lease_events_all). PostgreSQL plans a
    view's UNION ALL as one append of the table and the history's partitions, each
    read through its own index, so a lookup by id is an index probe per partition and
    a newest-first page merges index scans."""

    def replace(element: Any, **kw: Any) -> Any:
        if element in _VIEWS:
            return _VIEWS[element]
        table = getattr(element, "table", None)
        if isinstance(element, sa.Column) and table in _VIEWS:
            return _VIEWS[table].c[element.name]
        return None

    opts: dict[str, Any] = {}
    return cast(S, visitors.replacement_traverse(cast(visitors.ExternallyTraversible, stmt), opts, replace))


# --- the move ------------------------------------------------------------------------


def archivable(after: sa.ColumnElement) -> sa.ColumnElement[bool]:
    """Finished jobs the history takes: terminal, finished before ``after``, no
    idempotency key (a key's uniqueness is an index of celery_lease_jobs only)."""
    return sa.and_(_c.status.in_(_TERMINAL), _c.finished_at < after, _c.idempotency_key.is_(None))


def oldest_archivable() -> sa.Select:
    """oldest_archivable: the finish time of the oldest job archive_jobs would move
    (celery_lease_jobs_finished, in order); NULL when none is due."""
    return sa.select(sa.func.min(_c.finished_at)).where(archivable(db_now_plus(-_seconds("after_seconds"))))


@functools.cache
def archive_jobs() -> sa.Insert:
    """archive_jobs: a bounded chunk of archivable jobs (the oldest :limit finished more
    than :after_seconds ago) and their run events moved into the history, as ONE
    statement: each row is deleted and inserted in the same transaction, so a job is
    always in exactly one table. Locked with SKIP LOCKED: two beats move disjoint
    chunks. Returns the ids moved. Every day the chunk's finish times fall on must
    have its partitions (ensure_partitions), or the statement fails and moves nothing."""
    chunk = _chunk("archivable", archivable(db_now_plus(-_seconds("after_seconds"))), _c.finished_at, "limit")
    moved = sa.delete(jobs).where(_picked(chunk, "postgresql")).returning(*jobs.c).cte("moved")
    gone = sa.delete(events).where(events.c.job_id == moved.c.id).returning(*events.c, moved.c.finished_at).cte("gone")
    kept_events = sa.insert(history_events).from_select([c.name for c in history_events.c], sa.select(gone)).cte("kept")
    names = [c.name for c in jobs.c]
    return (
        sa.insert(history)
        .from_select(names, sa.select(*(moved.c[n] for n in names)))
        .returning(history.c.id)
        .add_cte(kept_events)
    )


# --- partitions ------------------------------------------------------------------------

#: One partition per UTC day of each history table: <table>_pYYYYMMDD.
PARTITION = re.compile(r"^celery_lease_history(?:_events)?_p(\d{8})$")
TABLES = (history.name, history_events.name)


def partition_name(table: str, day: dt.date) -> str:
    return f"{table}_p{day:%Y%m%d}"


def partition_day(name: str) -> dt.date | None:
    m = PARTITION.match(name)
    return dt.datetime.strptime(m.group(1), "%Y%m%d").date() if m else None


def partitions() -> sa.TextClause:
    """partitions: the names of the history tables' partitions."""
    return sa.text(
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
        " JOIN pg_class p ON p.oid = i.inhparent WHERE p.relname IN ('celery_lease_history', 'celery_lease_history_events')"
    )


#: Partition DDL of two beats (or a beat and an operator's prune) is one at a time.
DDL_LOCK = sa.text("SELECT pg_advisory_xact_lock(hashtext('celery_lease_history'))")

#: A partition's DDL waits at most this long for the parent's lock (a long read of the
#: history holds it), then gives up until the next tick, so no claim queues behind it.
DDL_LOCK_TIMEOUT = sa.text("SET LOCAL lock_timeout = '2s'")


def create_partition(table: str, day: dt.date) -> list[sa.TextClause]:
    """The partition of ``table`` for ``day`` (UTC), made as a table and attached: the
    attach takes the parent's SHARE UPDATE EXCLUSIVE lock (reads and the archive's
    inserts go on), where CREATE TABLE ... PARTITION OF takes its ACCESS EXCLUSIVE one."""
    name = partition_name(table, day)
    low, high = day, day + dt.timedelta(days=1)
    return [
        # (An attached partition must have its parent's CHECK constraints.)
        sa.text(f"CREATE TABLE {name} (LIKE {table} INCLUDING DEFAULTS INCLUDING CONSTRAINTS)"),
        sa.text(f"ALTER TABLE {table} ATTACH PARTITION {name} FOR VALUES FROM ('{low} 00:00+00') TO ('{high} 00:00+00')"),
    ]


def drop_partition(table: str, day: dt.date) -> list[sa.TextClause]:
    """A day's partition dropped whole: no row is deleted, so none is left dead."""
    name = partition_name(table, day)
    return [sa.text(f"ALTER TABLE {table} DETACH PARTITION {name}"), sa.text(f"DROP TABLE {name}")]
