"""The unit tier: no PostgreSQL, no Redis, no worker processes; runs in seconds.

Statements run against a migrated SQLite file per test (the embedded default dialect,
the same SQL catalogue); everything else is pure Python.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone

import pytest
import sqlalchemy as sa

from celery_lease.db import migrate
from celery_lease.db.schema import jobs
from celery_lease.db.store import Store


@pytest.fixture
def store(tmp_path):
    s = Store(f"sqlite:///{tmp_path / 'unit.sqlite3'}")
    migrate.upgrade(s)
    yield s
    s.dispose()


def _sqlite_time(delta: float) -> datetime:
    return datetime.now(timezone.utc) + timedelta(seconds=delta)


@pytest.fixture
def lifecycle(store):
    """The transition pipeline on the unit store (wakeups kept in ``lifecycle.woken``)."""
    from tests.conftest import local_pipeline

    return local_pipeline(store)


@pytest.fixture
def add_job(store):
    """Insert a job in any state: add_job(status=..., expires_in=..., **columns) -> id."""

    def add(
        *,
        status: str = "pending",
        expires_in: float | None = None,
        run_after_in: float | None = None,
        woken_ago: float | None = None,
        finished_ago: float | None = None,
        **columns,
    ) -> str:
        values = {
            "id": str(uuid.uuid4()),
            "kind": "echo",
            "task": "tests.echo",
            "status": status,
            "attempt": 0,
            "max_attempts": 3,
            "lease_seconds": 30,
            "lease_generation": 0,
            "payload": {},
            "created_at": _sqlite_time(0),
            "updated_at": _sqlite_time(0),
        }
        if expires_in is not None:
            values["lease_expires_at"] = _sqlite_time(expires_in)
        if run_after_in is not None:
            values["run_after"] = _sqlite_time(run_after_in)
        if woken_ago is not None:
            values["woken_at"] = _sqlite_time(-woken_ago)
        if finished_ago is not None:
            values["finished_at"] = _sqlite_time(-finished_ago)
        values.update(columns)
        with store.durable.begin() as conn:
            conn.execute(jobs.insert().values(**values))
        return values["id"]

    return add


@pytest.fixture
def row(store):
    def read(job_id: str) -> dict:
        with store.durable.connect() as conn:
            return dict(conn.execute(sa.select(jobs).where(jobs.c.id == job_id)).mappings().one())

    return read
