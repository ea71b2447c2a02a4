"""What a submit runs (celery_lease.producer): inserting jobs (one, or many sharing their columns in one
statement), reading back the jobs of an idempotency key or a retried insert, the
wakeups to publish, and the run a job joins."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from celery_lease.db.schema import ID, jobs, runs
from celery_lease.db.statements.common import (
    WAKEUP_COLUMNS,
    _c,
    db_now,
    db_now_plus,
    planned_once,
)
from celery_lease.db.statements.events import _events_of
from celery_lease.db.statements.fair import fair_key, fair_key_of_row
from celery_lease.status import Event, Status


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
        fair_key=fair_key_of_row(),  # bound by fair.fair_params
    ).returning(*jobs.c)


#: What one submit_many binds once for all its jobs (insert_shared_jobs).
SHARED_COLUMNS = (
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
PER_JOB_FIELDS = ("id", "payload", "idempotency_key", "concurrency_key")


@functools.cache
def insert_shared_jobs(*, on_key_conflict_nothing: bool, fair: bool, in_run: bool) -> Any:
    """insert_shared_jobs: new pending jobs of one submit (PostgreSQL), and with ``in_run``
    the ``dispatched`` event of each, in one statement.

    ``:jobs`` is one JSON array of records (``PER_JOB_FIELDS``; a missing field is
    NULL), read by json_to_recordset: one parameter whatever the number of jobs, payloads
    parsed once by the database, never escaped twice. Every other column is one value
    for all the jobs (``SHARED_COLUMNS``). Times are insert_jobs': the database
    clock, from ``:due_at`` / ``:due_in``.

    What a submit does not need is not in its statement, not skipped at run time: a kind
    that is not ``fair`` has no fair_key (its subqueries would be planned and opened at
    every EXECUTE), and jobs outside a run have no event (a second table and its indexes
    opened). A lone no-op submit costs ~0.1 ms less so, a sixth of the statement.

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
    values: dict[str, Any] = {name: per_job.c[name] for name in PER_JOB_FIELDS}
    for name in SHARED_COLUMNS:
        values[name] = sa.cast(sa.bindparam(name, type_=_c[name].type), _c[name].type)
    values.update(
        created_at=db_now(),
        updated_at=db_now(),
        run_after=sa.case((due_in.is_not(None), db_now_plus(due_in)), else_=due_at),
        woken_at=sa.case((sa.and_(due_in.is_(None), due_at.is_(None)), db_now()), else_=sa.null()),
    )
    if fair:
        # A fair kind's n-th job in the array is its tenant's n-th new one: the tenant's
        # last key is read once for the statement, the head once per row (its
        # concurrency key is the row's).
        nth = sa.func.row_number().over()
        values["fair_key"] = fair_key(
            values["kind"], values["queue"], values["concurrency_key"], values["priority"], values["tenant"], nth
        )
    insert = postgresql.insert(jobs).from_select(list(values), sa.select(*values.values()))
    if on_key_conflict_nothing:
        insert = insert.on_conflict_do_nothing()  # on the key or on the id
    else:
        insert = insert.on_conflict_do_nothing(index_elements=[_c.id])
    if not in_run:
        return planned_once(insert.returning(_c.id, _c.created_at, _c.run_after))
    inserted = insert.returning(_c.id, _c.run_id, _c.attempt, _c.created_at, _c.run_after).cte("inserted")
    dispatched = _events_of(inserted, sa.literal(Event.DISPATCHED.value), sa.null(), "dispatched")
    return planned_once(sa.select(inserted.c.id, inserted.c.created_at, inserted.c.run_after).add_cte(dispatched))


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
