"""The run event log: appending events, and the CTE by which one PostgreSQL statement
appends the events of the jobs it changed."""

from __future__ import annotations

import functools
from typing import Any

import sqlalchemy as sa

from celery_lease.db.schema import events
from celery_lease.db.statements.common import (
    db_now,
)
from celery_lease.status import Event

#: The execution option marking a statement that appends its own run events (logged()).
LOGGED = "celery_lease_logged"


def logged(stmt: Any) -> Any:
    """``stmt`` (whose CTE _events_of appends the events), marked as logging itself."""
    return stmt.execution_options(**{LOGGED: True})


def logs_itself(stmt: Any) -> bool:
    """Whether ``stmt`` appends its own run events; else its caller does (Store.log_events)."""
    return bool(stmt.get_execution_options().get(LOGGED, False))


def _events_of(source: sa.CTE, event: sa.ColumnElement, detail: sa.ColumnElement, name: str) -> sa.CTE:
    """The CTE ``name`` that appends, in the statement whose CTE ``source`` changed jobs,
    one run event per changed job that belongs to a run (its run_id, id and attempt):
    how a PostgreSQL statement writes its own events, the rows Store.log_events builds."""
    return events_cte(name, event_rows(source, event, detail))


def event_rows(source: sa.CTE, event: sa.ColumnElement, detail: sa.ColumnElement) -> sa.Select:
    """The run events of the jobs the CTE ``source`` changed (those of a run)."""
    return sa.select(source.c.run_id, source.c.id, event, source.c.attempt, detail, db_now()).where(source.c.run_id.is_not(None))


def events_cte(name: str, *rows: sa.Select) -> sa.CTE:
    """The CTE ``name`` appending the events ``rows`` (event_rows) in ONE insert: a
    statement that changes jobs in two ways (a claim carrying successes) pays for one
    insert into the events table, not one per way, even when it appends nothing."""
    columns = ["run_id", "job_id", "event", "attempt", "detail", "created_at"]
    return sa.insert(events).from_select(columns, rows[0] if len(rows) == 1 else sa.union_all(*rows)).cte(name)


@functools.cache
def append_events() -> sa.Insert:
    """append_events: rows of (run_id, job_id, event, attempt, detail)."""
    return sa.insert(events).values(created_at=db_now())


def event_row(run_id: str, job_id: str, event: Event, attempt: int, detail: str | None = None):
    return {"run_id": run_id, "job_id": job_id, "event": event.value, "attempt": attempt, "detail": detail}
