"""Real services for the tests: a throwaway PostgreSQL database per run, a private
Redis server per run (so fault tests may restart it), and real `celery worker`
subprocesses killed by PID.

Environment: CL_TEST_PG_ADMIN (default postgresql+psycopg2://root@127.0.0.1:5432/postgres).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from celery_lease.worker.attempt import Attempt
from tests.harness import rabbitmq
from tests.harness.services import (  # noqa: F401  (re-exported to the tests)
    PG_ADMIN,
    RedisServer,
    free_port,
    throwaway_database,
    wait_for,
)

ROOT = Path(__file__).resolve().parent.parent
CELERY = str(Path(sys.executable).with_name("celery"))


#: One-line results that tests want in the terminal summary (e.g. the chaos line).
SUMMARY_LINES = pytest.StashKey[list]()


def pytest_collection_modifyitems(config, items):
    """``slow`` tests (long chaos variants) run only when asked for with ``-m slow``,
    so the default run (the README's test command, CI) stays short."""
    if "slow" in (config.option.markexpr or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    lines = config.stash.get(SUMMARY_LINES, [])
    if lines:
        terminalreporter.section("summary lines")
        for line in lines:
            terminalreporter.write_line(line)


# --- PostgreSQL -----------------------------------------------------------------------


@pytest.fixture(scope="session")
def pg_url():
    """A throwaway database for this run, migrated once; dropped at the end."""
    from celery_lease.db import migrate
    from celery_lease.db.store import Store
    from tests.apps.app import test_metadata

    with throwaway_database("celery_lease_test") as url:
        store = Store(url)
        migrate.upgrade(store)
        test_metadata.create_all(store.durable)
        store.dispose()
        yield url


TABLES = (
    "celery_lease_events",
    "celery_lease_runs",
    "celery_lease_jobs",
    "celery_lease_chords",
    "celery_lease_limits",
    "celery_lease_pauses",
    "celery_lease_tenant_weights",
    "celery_lease_landings",
    "celery_lease_outbox",
    "celery_lease_history",
    "celery_lease_history_events",
    "test_effects",
)


@pytest.fixture
def pg(pg_url):
    """The run's PostgreSQL database, emptied before the test."""
    engine = sa.create_engine(pg_url)
    with engine.begin() as conn:
        conn.exec_driver_sql(f"TRUNCATE {', '.join(TABLES)}")
    yield pg_url
    engine.dispose()


@pytest.fixture
def sqlite_url(tmp_path):
    """A fresh SQLite file, migrated."""
    url = f"sqlite:///{tmp_path / 'jobs.sqlite3'}"
    from celery_lease.db import migrate
    from celery_lease.db.store import Store
    from tests.apps.app import test_metadata

    store = Store(url)
    migrate.upgrade(store)
    test_metadata.create_all(store.durable)
    store.dispose()
    return url


# --- Redis ----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def broker(redis_server):
    """The private Redis, running and empty."""
    if not redis_server.ping():
        redis_server.start()
    redis_server.flush()
    return redis_server.url


# --- RabbitMQ -------------------------------------------------------------------------


@pytest.fixture(scope="session")
def rabbit_node(tmp_path_factory):
    """A private RabbitMQ node (tests/harness/rabbitmq.py), booted once per run."""
    if not rabbitmq.available():
        pytest.skip("needs rabbitmq-server (bash dev.sh test installs it)")
    node = rabbitmq.RabbitNode(tmp_path_factory.mktemp("rabbitmq"))
    node.start()
    yield node
    node.stop()


@pytest.fixture
def amqp_broker(rabbit_node):
    """A throwaway vhost of the private RabbitMQ node (running again if a test stopped it)."""
    if not rabbit_node.ping():
        rabbit_node.start()
    broker = rabbitmq.RabbitBroker(rabbit_node, rabbit_node.add_vhost())
    yield broker
    rabbit_node.delete_vhost(broker.vhost)


# --- Celery apps and workers ----------------------------------------------------------


def _env(db: str, broker: str, conf: dict | None = None, extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.update(
        {
            "CL_TEST_DB": db,
            "CL_TEST_BROKER": broker,
            "CL_TEST_CONF": json.dumps(conf or {}),
            "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.update(extra or {})
    return env


@pytest.fixture
def client_app(monkeypatch):
    """Build the tests' Celery app in this process, pointed at a database and broker.

    Returns a function (db_url, broker_url, conf=None, extra_env=None, module="tests.apps.app")
    -> the freshly imported app module (exposing ``app`` and ``leases``).
    """
    import importlib

    made = []

    def make(db: str, broker: str, conf: dict | None = None, extra_env: dict | None = None, module: str = "tests.apps.app"):
        for key, value in _env(db, broker, conf, extra_env).items():
            monkeypatch.setenv(key, value)
        # App modules read the environment at import: drop every cached one (an app
        # module may import tests.apps.app) so this import sees this test's settings.
        for name in [n for n in sys.modules if n == module or n.startswith("tests.apps.app")]:
            sys.modules.pop(name)
        mod = importlib.import_module(module)
        made.append(mod)
        return mod

    yield make
    for mod in made:
        _forget_attempts(mod)
        mod.leases.store.dispose()
        mod.app.close()
        sys.modules.pop(mod.__name__, None)


def _forget_attempts(mod) -> None:
    """A test's in-process worker threads outlive it (daemon Drainers are never stopped):
    the attempts its heartbeat still holds (claimed, never run) were renewed during a
    later test, against that test's emptied tables, and logged "lease lost" there (seen
    once under load, in test_batch's renewal test)."""
    state = getattr(mod.leases, "_worker", None)
    if state is not None:
        with state.heartbeat._cond:
            state.heartbeat._attempts.clear()


class Worker:
    """A real `celery worker` subprocess running tests.apps.app."""

    def __init__(
        self,
        name: str,
        db: str,
        broker: str,
        logdir: Path,
        *,
        concurrency: int = 2,
        pool: str = "prefork",
        conf: dict | None = None,
        extra_env: dict | None = None,
        queues: str | None = None,
        module: str = "tests.apps.app",
        loglevel: str = "INFO",
        as_deployed: bool = False,
    ) -> None:
        """``as_deployed``: Celery's default bootsteps (mingle, gossip, heartbeat) and task
        events (``-E``, for Flower), as teams run workers; else without them, to start fast
        and keep the broker quiet."""
        self.name = name
        self.log_path = logdir / f"{name}-{uuid.uuid4().hex[:6]}.log"
        self.args = [
            CELERY,
            "-A",
            module,
            "worker",
            "-n",
            f"{name}@testhost",
            "-P",
            pool,
            "-c",
            str(concurrency),
            "-l",
            loglevel,
        ]
        self.args += ["-E"] if as_deployed else ["--without-mingle", "--without-gossip", "--without-heartbeat"]
        if queues:
            self.args += ["-Q", queues]
        self.env = _env(db, broker, conf, extra_env)
        self.proc: subprocess.Popen | None = None

    def start(self, wait: bool = True) -> Worker:
        self._log = open(self.log_path, "a")
        since = len(self.log())  # a restart appends: only this boot's "ready." counts
        self.proc = subprocess.Popen(
            self.args, env=self.env, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        if wait:
            wait_for(
                lambda: "ready." in self.log()[since:] or self.proc.poll() is not None,
                timeout=30,
                what=f"worker {self.name} to be ready",
            )
            assert self.proc.poll() is None, f"worker {self.name} exited:\n{self.log()[-3000:]}"
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid

    def children(self) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(self.pid)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def log(self) -> str:
        try:
            return self.log_path.read_text()
        except FileNotFoundError:
            return ""

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Kill the whole worker (main process and pool children) with ``sig``."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(timeout=30)

    def stop(self, timeout: float = 30) -> int:
        """Warm shutdown (SIGTERM to the main process) and wait."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"worker {self.name} did not stop in {timeout}s")

    def restart(self) -> Worker:
        self.kill()
        return self.start()


@pytest.fixture
def workers(tmp_path):
    """Start workers with ``workers(db, broker, name=..., **options)``; all are killed
    at the end of the test."""
    started: list[Worker] = []

    def start(db: str, broker: str, name: str = "w1", wait: bool = True, **options) -> Worker:
        worker = Worker(name, db, broker, tmp_path, **options)
        started.append(worker)
        return worker.start(wait=wait)

    yield start
    for worker in started:
        worker.kill()


class Beat:
    """A real `celery beat` subprocess."""

    def __init__(
        self,
        db: str,
        broker: str,
        workdir: Path,
        conf: dict | None = None,
        module: str = "tests.apps.app",
        extra_env: dict | None = None,
        env_hook=None,
        loglevel: str = "INFO",
    ) -> None:
        self.log_path = workdir / f"beat-{uuid.uuid4().hex[:6]}.log"
        schedule = workdir / f"beat-schedule-{uuid.uuid4().hex[:6]}"
        # Maintenance ticks log at DEBUG: tests that count beat's sends ask for DEBUG.
        self.args = [CELERY, "-A", module, "beat", "-l", loglevel, "-s", str(schedule)]
        self.env = _env(db, broker, conf, extra_env)
        if env_hook is not None:  # e.g. tests.harness.faketime.skewed_env: a skewed clock
            self.env = env_hook(self.env)
        self.proc = None

    def start(self) -> Beat:
        self._log = open(self.log_path, "a")
        self.proc = subprocess.Popen(
            self.args, env=self.env, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        return self

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture
def beats(tmp_path):
    started: list[Beat] = []

    def start(db: str, broker: str, conf: dict | None = None, module: str = "tests.apps.app", **options) -> Beat:
        beat = Beat(db, broker, tmp_path, conf, module, **options)
        started.append(beat)
        return beat.start()

    yield start
    for beat in started:
        beat.kill()


# --- a job in any state ---------------------------------------------------------------


@pytest.fixture
def make_job():
    """Insert a job row directly in any state: make_job(db_url, status=..., **columns).

    For tests of transitions that should not depend on a worker getting there first.
    """
    from celery_lease.db.schema import jobs

    engines: dict[str, sa.Engine] = {}

    def make(db: str, *, kind: str = "echo", task: str = "tests.apps.app.echo", status: str = "pending", **columns) -> str:
        engine = engines.setdefault(db, sa.create_engine(db))
        from celery_lease.db.statements.common import db_now

        now = db_now()
        values = {
            "id": str(uuid.uuid4()),
            "kind": kind,
            "task": task,
            # As submit stores it for tests.apps.app: its routed queue (celery_lease.broker.routing).
            "queue": "celery",
            "status": status,
            "attempt": 0,
            "max_attempts": 3,
            "lease_seconds": 30,
            "lease_generation": 0,
            "payload": {},
            "created_at": now,
            "updated_at": now,
        }
        values.update(columns)
        with engine.begin() as conn:
            conn.execute(jobs.insert().values(**values))
        return values["id"]

    yield make
    for engine in engines.values():
        engine.dispose()


@pytest.fixture
def pg_proxy():
    """A TcpProxy to the test PostgreSQL (tests/harness/tcpproxy.py): ``url_for(db)``."""
    from tests.harness.tcpproxy import TcpProxy

    url = sa.engine.make_url(PG_ADMIN)
    proxy = TcpProxy(url.host or "127.0.0.1", url.port or 5432).start()
    yield proxy
    proxy.close()


@pytest.fixture
def marker_dir(tmp_path):
    d = tmp_path / "markers"
    d.mkdir()
    return d


def local_pipeline(store):
    """The transition pipeline on ``store`` with no broker: the wakeups it sends are
    kept in ``pipeline.woken``."""
    from celery import Celery

    from celery_lease.lifecycle.pipeline import Pipeline
    from celery_lease.settings import Settings
    from celery_lease.worker.eager import _LocalProducer

    app = Celery("local", set_as_current=False)
    producer = _LocalProducer(app, store, Settings.resolve(app.conf, {}))
    pipeline = Pipeline(store, producer)
    pipeline.woken = producer.woken  # type: ignore[attr-defined]
    return pipeline


def attempt_for(job_id: str, generation: int = 1, **fields: Any) -> Attempt:
    """A worker's Attempt of a claimed job as the tests need one; ``fields`` override
    the first-attempt defaults below."""
    values: dict[str, Any] = {
        "attempt": 1,
        "max_attempts": 3,
        "lease_seconds": 30,
        "run_id": None,
        "parent_id": None,
        "tenant": None,
        "payload": {},
        "checkpoint": None,
    }
    return Attempt(job_id=job_id, generation=generation, **{**values, **fields})


def ended(store, ending) -> bool:
    """Write one ``ending`` (transition.Ending) alone, as a bare fenced write: whether
    its row moved."""
    from celery_lease.db.statements.attempt import end_jobs
    from celery_lease.lifecycle.transition import ending_params

    return store.guarded(end_jobs(store.dialect), ending_params([ending]))


@pytest.fixture
def db(pg):
    """An engine on the test's database (a test module may define its own)."""
    engine = sa.create_engine(pg)
    yield engine
    engine.dispose()


def row(db, job_id: str) -> dict:
    """The job row ``job_id``, as a dict."""
    from celery_lease.db.schema import jobs

    with db.connect() as conn:
        return dict(conn.execute(sa.select(jobs).where(jobs.c.id == job_id)).mappings().one())
