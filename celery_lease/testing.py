"""Testing a project's leased jobs: handlers run in-process on a throwaway database, with
no broker and no worker.

Enable the pytest plugin in your ``conftest.py``::

    pytest_plugins = ["celery_lease.testing"]

It is not registered as an auto-loaded (``pytest11``) plugin on purpose: every pytest run
in an environment where celery-lease is installed would import Celery and SQLAlchemy and
get these fixture names, wanted or not.

Fixtures:

``lease_database_url``
    A migrated database for one test: a SQLite file in the test's ``tmp_path``, or, when
    ``CELERY_LEASE_TEST_PG_ADMIN`` holds an admin URL (``postgresql+psycopg2://user@host/postgres``),
    a throwaway PostgreSQL database created for the test and dropped after it.
``lease_eager``
    ``lease_eager(leases)`` switches your ``CeleryLease`` to ``lease_database_url`` and eager
    mode (``task_always_eager``) for the test and restores it afterwards. Then
    ``task.delay(p)`` / ``apply_async`` / ``apply`` return a finished ``LeaseResult`` and
    ``task(p)`` the finished ``Job``: the handler ran here, once per attempt, with the same
    claim, fenced writes, checkpoints, effects, ``Failure`` and retries (at once, without the
    backoff) as in a worker; children and chain steps ran too; nothing reached the broker.

Without pytest: ``with celery_lease.testing.eager(leases, database_url): ...``.

Beside Celery's own fixtures (``celery.contrib.pytest``: ``celery_app``, ``celery_worker``):
create ``CeleryLease(celery_app, database_url=lease_database_url)`` and declare the jobs in
a fixture requested *before* ``celery_worker``, so the in-process worker thread (memory
broker, solo pool) starts with them registered; leased jobs then run through that real
worker, with the job rows in the throwaway database. pytest-celery 1.x's worker fixtures
run workers in Docker containers; where Docker is not available, use the two ways above.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import sqlalchemy as sa

from celery_lease.db import migrate
from celery_lease.db.store import Store
from celery_lease.extension import CeleryLease
from celery_lease.job import Job

#: Environment variable naming a PostgreSQL admin URL for throwaway test databases.
PG_ADMIN_ENV = "CELERY_LEASE_TEST_PG_ADMIN"

#: The parts a CeleryLease makes on first use from its database URL (extension.py).
_PARTS = ("_store", "_producer", "_maintenance", "_worker", "_eager")


def migrated(url: str) -> str:
    """Apply celery-lease's migrations to ``url``; returns it."""
    store = Store(url)
    try:
        migrate.upgrade(store)
    finally:
        store.dispose()
    return url


@contextmanager
def throwaway_postgres(admin_url: str) -> Iterator[str]:
    """A new, empty PostgreSQL database (dropped on exit, with its sessions)."""
    name = f"celery_lease_test_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
        try:
            yield sa.engine.make_url(admin_url).set(database=name).render_as_string(hide_password=False)
        finally:
            with admin.connect() as conn:
                conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        admin.dispose()


@contextmanager
def eager(leases: CeleryLease, database_url: str | None = None) -> Iterator[CeleryLease]:
    """Run ``leases``' jobs in-process on ``database_url`` (migrated here; default: the
    configured one) with ``task_always_eager`` on; both are restored on exit."""
    saved = {part: getattr(leases, part) for part in (*_PARTS, "_database_url")}
    conf = leases.app.conf
    was_eager = conf.task_always_eager
    try:
        if database_url is not None:
            for part in _PARTS:
                setattr(leases, part, None)
            leases._database_url = migrated(database_url)
        conf.task_always_eager = True
        yield leases
    finally:
        conf.task_always_eager = was_eager
        if database_url is not None and leases._store is not None:
            leases._store.dispose()
        for part, value in saved.items():
            setattr(leases, part, value)


def run(task: Any, payload: Any) -> Job:
    """Run one job of ``task`` here to a terminal status (same as ``task(payload)``)."""
    return task(payload)


@pytest.fixture
def lease_database_url(tmp_path) -> Iterator[str]:
    admin = os.environ.get(PG_ADMIN_ENV)
    if admin:
        with throwaway_postgres(admin) as url:
            yield migrated(url)
    else:
        yield migrated(f"sqlite:///{tmp_path / 'celery-lease-test.sqlite3'}")


@pytest.fixture
def lease_eager(lease_database_url) -> Iterator[Callable[[CeleryLease], CeleryLease]]:
    stack: list[Any] = []

    def switch(leases: CeleryLease) -> CeleryLease:
        context = eager(leases, lease_database_url)
        stack.append(context)
        return context.__enter__()

    yield switch
    while stack:
        stack.pop().__exit__(None, None, None)
