"""Testing a project's leased jobs with pytest: handlers run on a throwaway database,
in-process (eager) or through a real Celery worker thread, with no broker server.

A pytest plugin, registered by entry point (``pytest11``): a test module needs no
``conftest.py``, ``-p no:celery_lease.testing`` turns it off, and a conftest's
``pytest_plugins = ["celery_lease.testing"]`` is harmless. Its fixtures (``lease_app``,
``lease_database_url``, ``celery_lease``, ``lease_worker``, ``lease_eager``) start with
``lease_`` or are ``celery_lease``, so they stand beside pytest-celery's and Celery's
own; docs/converting.md#tests shows them at work. Without pytest:
``with celery_lease.testing.eager(leases, database_url): ...``.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from celery_lease.broker.routing import QueueRouter, consumed_queues
from celery_lease.db import migrate
from celery_lease.db.store import Store
from celery_lease.extension import CeleryLease
from celery_lease.job import Job

log = logging.getLogger("celery_lease")

#: Environment variable naming a PostgreSQL admin URL for throwaway test databases.
PG_ADMIN_ENV = "CELERY_LEASE_TEST_PG_ADMIN"
#: Ini option / environment variable naming the app under test ("proj.celery:app").
APP_OPTION, APP_ENV = "celery_lease_app", "CELERY_LEASE_TEST_APP"

#: The parts a CeleryLease makes on first use from its database URL (extension.py).
_PARTS = ("_store", "_producer", "_maintenance", "_flow", "_worker", "_eager")

#: Seconds between the maintenance passes ``lease_worker`` runs in place of beat.
MAINTENANCE_INTERVAL = 0.2


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
def switched(leases: CeleryLease, database_url: str | None) -> Iterator[CeleryLease]:
    """``leases`` on ``database_url`` (migrated here; None: unchanged) until exit, when
    its parts made on that database are disposed and the earlier ones put back."""
    saved = {part: getattr(leases, part) for part in (*_PARTS, "_database_url")}
    try:
        if database_url is not None:
            for part in _PARTS:
                setattr(leases, part, None)
            leases._database_url = migrated(database_url)
        yield leases
    finally:
        if database_url is not None and leases._store is not None:
            leases._store.dispose()
        for part, value in saved.items():
            setattr(leases, part, value)


@contextmanager
def eager(leases: CeleryLease, database_url: str | None = None) -> Iterator[CeleryLease]:
    """Run ``leases``' jobs in-process on ``database_url`` (migrated here; default: the
    configured one) with ``task_always_eager`` on; both are restored on exit."""
    conf = leases.app.conf
    was_eager = conf.task_always_eager
    with switched(leases, database_url):
        try:
            conf.task_always_eager = True
            yield leases
        finally:
            conf.task_always_eager = was_eager


@contextmanager
def memory_broker(app: Celery) -> Iterator[None]:
    """``app`` publishes to and consumes from kombu's in-process memory transport until exit."""
    conf = app.conf
    saved = conf.broker_url, conf.task_always_eager
    conf.broker_url, conf.task_always_eager = "memory://", False
    _drop_connections(app)
    try:
        yield
    finally:
        conf.broker_url, conf.task_always_eager = saved
        _drop_connections(app)


def _drop_connections(app: Celery) -> None:
    """Forget the app's broker connection and producer pools (made from ``broker_url`` on
    first use), as Celery itself does after a fork."""
    app._pool = None
    amqp = app.__dict__.get("amqp")
    if amqp is not None:
        amqp._producer_pool = None


@contextmanager
def maintenance(leases: CeleryLease, interval: float = MAINTENANCE_INTERVAL) -> Iterator[None]:
    """A thread doing beat's work (sweep: retries, delayed jobs, lost wakeups; reap:
    elapsed leases) every ``interval`` seconds until exit."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(interval):
            try:
                leases.sweep()
                leases.reap()
            except Exception:  # a pass that fails is retried at the next one, as beat's
                log.warning("celery-lease test maintenance pass failed", exc_info=True)

    thread = threading.Thread(target=loop, name="celery-lease-test-maintenance", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)


def load_app(spec: str) -> Celery:
    """The Celery app named ``module:attribute`` (or ``module``, whose ``app`` or
    ``celery_app`` it is)."""
    module_name, _, attribute = spec.partition(":")
    module = importlib.import_module(module_name)
    for name in [attribute] if attribute else ["app", "celery_app"]:
        app = getattr(module, name, None)
        if isinstance(app, Celery):
            return app
    raise pytest.UsageError(f"celery-lease: {spec!r} names no Celery app")


def run(task: Any, payload: Any) -> Job:
    """Run one job of ``task`` here to a terminal status (same as ``task(payload)``)."""
    return task(payload)


@pytest.fixture
def lease_database_url(tmp_path) -> Iterator[str]:
    """A migrated database for one test: a SQLite file in the test's ``tmp_path``, or, when
    ``CELERY_LEASE_TEST_PG_ADMIN`` holds an admin URL (``postgresql+psycopg2://user@host/postgres``),
    a throwaway PostgreSQL database created for the test and dropped after it."""
    admin = os.environ.get(PG_ADMIN_ENV)
    if admin:
        with throwaway_postgres(admin) as url:
            yield migrated(url)
    else:
        yield migrated(f"sqlite:///{tmp_path / 'celery-lease-test.sqlite3'}")


@pytest.fixture
def lease_eager(lease_database_url) -> Iterator[Callable[[CeleryLease], CeleryLease]]:
    """``lease_eager(leases)`` switches ``leases`` to ``lease_database_url`` and eager mode
    (``task_always_eager``) for the test. ``delay`` / ``apply_async`` / ``apply`` then return
    a finished ``LeaseResult`` and ``task(p)`` the finished ``Job``: the handler ran here,
    once per attempt, with the worker's claim, fenced writes, checkpoints, effects,
    ``Failure`` and retries (at once, without the backoff); children and chain steps ran
    too; nothing reached the broker."""
    stack: list[Any] = []

    def switch(leases: CeleryLease) -> CeleryLease:
        context = eager(leases, lease_database_url)
        stack.append(context)
        return context.__enter__()

    yield switch
    while stack:
        stack.pop().__exit__(None, None, None)


def pytest_addoption(parser) -> None:
    parser.addini(APP_OPTION, "the Celery app whose leased jobs the tests run (module:attribute)", default="")


@pytest.fixture
def lease_app(request) -> Celery:
    """The Celery app under test: the one named by the ini option ``celery_lease_app``
    (``"proj.celery:app"``) or ``CELERY_LEASE_TEST_APP``; else Celery's own ``celery_app``
    fixture (a memory broker, configured by ``celery_config``). Override it in a test module
    to pick another app."""
    spec = request.config.getini(APP_OPTION) or os.environ.get(APP_ENV)
    if spec:
        return load_app(spec)
    try:
        return request.getfixturevalue("celery_app")
    except pytest.FixtureLookupError:
        raise pytest.UsageError(
            f"celery-lease: name the app under test (ini option {APP_OPTION} = 'proj.celery:app', "
            f"{APP_ENV}, or a lease_app fixture), or install pytest-celery for Celery's celery_app"
        ) from None


@pytest.fixture
def celery_lease(lease_app, lease_database_url) -> Iterator[CeleryLease]:
    """The ``CeleryLease`` of ``lease_app``, switched to ``lease_database_url`` for the test
    (its parts are remade on that database and restored afterwards)."""
    leases = getattr(lease_app, "lease", None)
    if not isinstance(leases, CeleryLease):
        raise pytest.UsageError(f"celery-lease: the app {lease_app.main!r} has no CeleryLease (create CeleryLease(app) in it)")
    with switched(leases, lease_database_url):
        yield leases


@pytest.fixture
def lease_worker(celery_lease) -> Iterator[CeleryLease]:
    """``celery_lease`` with a real Celery worker in a thread of the test process (solo pool;
    the app's ``broker_url`` is ``memory://`` for the test) consuming every queue the app
    routes to (:func:`worker_queues`; a router function's per-payload queues must be in
    ``task_queues``), and a thread doing beat's sweep and reap every 0.2 s, so retries and
    delayed jobs run. Claims, heartbeats, fenced writes and retries are production's."""
    from celery.contrib.testing.worker import start_worker

    app = celery_lease.app
    with memory_broker(app), maintenance(celery_lease):
        with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=30, queues=worker_queues(celery_lease)):
            yield celery_lease


def worker_queues(leases: CeleryLease) -> list[str]:
    """The queues ``lease_worker`` consumes: every one the app routes to (celery_lease.broker.routing),
    each leased kind's as routed without a payload included."""
    router = QueueRouter(leases.app)
    kinds: list[str | None] = []
    for spec in leases.registry:
        try:
            kinds.append(router.queue(spec.task, spec.queue, None))
        except Exception:  # a router function that needs a real payload: its queues are task_queues'
            log.debug("celery-lease: no queue for kind %s without a payload", spec.kind, exc_info=True)
    return consumed_queues(leases.app, kinds)
