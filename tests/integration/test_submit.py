"""The producer boundary: bad input is refused at submit and stores nothing;
transactional enqueue publishes only after COMMIT; configuration errors are clear."""

from __future__ import annotations

import subprocess
import threading
import time
import uuid
from datetime import datetime

import pytest
import redis
import sqlalchemy as sa
from celery import Celery

from celery_lease import CeleryLease, ConfigurationError, InvalidPayload, Status, UnknownKind
from celery_lease.db.schema import jobs
from celery_lease.errors import DatabaseUnavailable
from tests.conftest import CELERY, ROOT, _env, wait_for


class Statements(list):
    """Statements seen, and the thread that sent each one."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[int] = []

    def clear(self) -> None:
        super().clear()
        self.threads.clear()

    def of_this_thread(self) -> list[str]:
        me = threading.get_ident()
        return [s for s, t in zip(self, self.threads) if t == me]


@pytest.fixture
def statements():
    """Every SQL statement this process sends, on any engine."""
    seen = Statements()

    def record(conn, cursor, statement, *args):
        seen.append(statement)
        seen.threads.append(threading.get_ident())

    sa.event.listen(sa.engine.Engine, "before_cursor_execute", record)
    yield seen
    sa.event.remove(sa.engine.Engine, "before_cursor_execute", record)


def count_jobs(url: str) -> int:
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        n = conn.execute(sa.select(sa.func.count()).select_from(jobs)).scalar()
    engine.dispose()
    return n


def queued(broker: str, queue: str = "celery") -> int:
    return redis.Redis.from_url(broker).llen(queue)


@pytest.mark.parametrize(
    "payload, message",
    [
        ({"when": datetime(2026, 1, 1)}, "not JSON serializable"),
        ({"x": float("nan")}, "Out of range float"),
        ({"blob": "x" * (1024 * 1024 + 1)}, "over the cap"),
    ],
)
def test_bad_payload_raises_at_submit_and_stores_nothing(pg, broker, client_app, payload, message):
    mod = client_app(pg, broker)
    with pytest.raises(InvalidPayload, match=message):
        mod.echo.submit(payload)
    assert count_jobs(pg) == 0 and queued(broker) == 0


def test_typed_payload_validation_fails_at_submit(pg, broker, client_app):
    mod = client_app(pg, broker)
    with pytest.raises(InvalidPayload, match="quantity"):
        mod.typed_pd.submit({"sku": "A-1", "quantity": "many"})
    with pytest.raises(InvalidPayload):
        mod.typed_dc.submit({"x": 1})  # missing y
    assert count_jobs(pg) == 0


def test_unknown_kind_raises(pg, broker, client_app):
    mod = client_app(pg, broker)
    with pytest.raises(UnknownKind, match="no job handler for kind 'nope'"):
        mod.leases.submit("nope", {})
    assert count_jobs(pg) == 0


def test_naive_run_after_is_refused(pg, broker, client_app):
    mod = client_app(pg, broker)
    with pytest.raises(InvalidPayload, match="timezone-aware"):
        mod.echo.submit({}, run_after=datetime(2030, 1, 1))
    assert count_jobs(pg) == 0


def test_transactional_submit_publishes_only_after_commit(pg, broker, client_app, workers):
    mod = client_app(pg, broker)
    engine = sa.create_engine(pg)
    with engine.begin() as conn:
        job = mod.echo.submit({"value": "tx"}, connection=conn)
        # Inside the transaction: no wakeup yet, and the row is invisible to others.
        assert queued(broker) == 0
        assert mod.leases.get(job.id) is None
    assert queued(broker) == 1
    workers(pg, broker)
    assert mod.leases.wait(job.id, 20).status is Status.SUCCEEDED
    engine.dispose()


def test_rolled_back_submit_leaves_no_job_and_no_wakeup(pg, broker, client_app):
    mod = client_app(pg, broker)
    engine = sa.create_engine(pg)
    with pytest.raises(RuntimeError):
        with engine.begin() as conn:
            job = mod.echo.submit({"value": "gone"}, connection=conn)
            raise RuntimeError("caller aborts")
    assert mod.leases.get(job.id) is None
    assert count_jobs(pg) == 0 and queued(broker) == 0
    # The same connection's next transaction does not carry the dropped wakeup over.
    with engine.begin() as conn:
        kept = mod.echo.submit({"value": "kept"}, connection=conn)
    assert queued(broker) == 1 and mod.leases.get(kept.id) is not None
    engine.dispose()


def test_submit_many_is_one_insert(pg, broker, client_app, statements, monkeypatch):
    from celery_lease.db.prepared import Prepared

    real_execute = Prepared.execute

    def counted(self, dbapi_connection, info, params):
        statements.append(self.prepare_sql.split(" AS ", 1)[1])
        return real_execute(self, dbapi_connection, info, params)

    monkeypatch.setattr(Prepared, "execute", counted)
    mod = client_app(pg, broker)
    created = mod.echo.submit_many([{"value": i} for i in range(250)])
    assert len(created) == 250 and len({j.id for j in created}) == 250
    # WITH inserted AS (INSERT ... RETURNING), dispatched AS (INSERT events ...) SELECT
    assert len(statements) == 1 and statements[0].lstrip().upper().startswith("WITH")
    # One wakeup for the 250 (waking.py): its claim takes what is due.
    assert count_jobs(pg) == 250 and queued(broker) == 1


@pytest.mark.parametrize("prepare", [False, True])
def test_statements_per_job_from_submit_to_success(pg, broker, client_app, statements, monkeypatch, prepare):
    """Steady state: one statement at submit, one at claim, one at completion; with
    prepared statements on, claim and completion are EXECUTEs of prepared statements."""
    from celery.contrib.testing.worker import start_worker

    from celery_lease.db.prepared import Prepared

    executed: list[str] = []
    executed_here: list[str] = []  # by the submitting thread (the worker claims in another)
    real_execute = Prepared.execute

    def counted(self, dbapi_connection, info, params):
        executed.append(self.prepare_sql.split(" AS ", 1)[1].split()[0].upper())
        if threading.get_ident() == main:
            executed_here.append(executed[-1])
        return real_execute(self, dbapi_connection, info, params)

    main = threading.get_ident()
    monkeypatch.setattr(Prepared, "execute", counted)
    mod = client_app(pg, broker, conf={"lease_prepare_statements": prepare})
    with start_worker(mod.app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
        warm = mod.echo.submit({"value": "warm-up"})  # connect outside the count
        mod.leases.wait(warm.id, 20)
        statements.clear()
        executed.clear()
        executed_here.clear()
        job = mod.echo.submit({"value": 1})
        submitted = [s.split()[0].upper() for s in statements.of_this_thread()] + executed_here
        assert mod.leases.wait(job.id, 20).status is Status.SUCCEEDED
        during = [s for s in statements if "celery_lease_jobs" in s]
    # The waits' SELECTs are the test's own polling, not the job's cost.
    cost = [
        s.split()[0].upper()
        for s in during
        if not s.lstrip().upper().startswith("SELECT") or s.lstrip().upper().startswith("WITH")
    ]
    assert submitted == ["WITH"]  # the row (+ its run event, in one statement)
    # submit; claim; completion (each + its run event, in one statement)
    assert sorted(cost + executed) == ["WITH", "WITH", "WITH"], (cost, executed)
    assert len(executed) == (3 if prepare else 0)


def test_database_url_precedence(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CELERY_LEASE_DATABASE_URL", raising=False)
    app = Celery("p", broker="memory://")
    assert CeleryLease(app).store.url.database == str(tmp_path / "celery-lease.sqlite3")
    monkeypatch.setenv("CELERY_LEASE_DATABASE_URL", "sqlite:///from-env.db")
    assert CeleryLease(Celery("p2", broker="memory://")).store.url.database == "from-env.db"
    app3 = Celery("p3", broker="memory://")
    app3.conf.lease_database_url = "sqlite:///from-conf.db"
    assert CeleryLease(app3).store.url.database == "from-conf.db"
    assert CeleryLease(Celery("p4", broker="memory://"), "sqlite:///explicit.db").store.url.database == "explicit.db"


@pytest.mark.parametrize(
    "url, message",
    [
        ("not a url", "database_url is not a valid database URL"),
        ("mysql://root@localhost/db", "unsupported database 'mysql'"),
    ],
)
def test_bad_database_url_fails_at_construction(url, message):
    with pytest.raises(ConfigurationError, match=message):
        CeleryLease(Celery("bad", broker="memory://"), url)


def test_a_bare_postgresql_url_works_with_the_installed_driver(pg):
    bare = sa.engine.make_url(pg).set(drivername="postgresql").render_as_string(hide_password=False)
    assert bare.startswith("postgresql://")
    leases = CeleryLease(Celery("bare_url", broker="memory://"), bare)

    @leases.job(kind="bare_url_noop")
    def noop(ctx, payload):
        return None

    try:
        job = noop.submit({"n": 1})
        assert leases.get(job.id).payload == {"n": 1}
    finally:
        leases.store.dispose()


def test_submit_to_an_unreachable_database_raises_one_clear_error_without_driver_text():
    # A single submit on PostgreSQL runs as a prepared statement on a raw driver
    # connection; its failed connect must read like every other: DatabaseUnavailable,
    # the URL without its password, no psycopg2 message.
    app = Celery("unreachable", broker="memory://")
    leases = CeleryLease(app, "postgresql+psycopg2://root:topsecret@127.0.0.1:1/nowhere")

    @leases.job(kind="unreachable_noop")
    def noop(ctx, payload):
        return None

    for submit in (lambda: noop.submit({}), lambda: noop.submit_many([{}, {}])):
        with pytest.raises(DatabaseUnavailable) as caught:
            submit()
        text = str(caught.value)
        assert "cannot reach the job database" in text
        assert "topsecret" not in text and "Connection refused" not in text and "port 1 failed" not in text


@pytest.mark.parametrize(
    "url, says",
    [
        (
            "postgresql+psycopg2://root:topsecret@127.0.0.1:5432/no_such_db_3f1a",
            "the server at 127.0.0.1:5432 has no database 'no_such_db_3f1a'",
        ),
        ("postgresql+psycopg2://root:topsecret@127.0.0.1:1/postgres", "cannot connect to the server at 127.0.0.1:1"),
        (
            "postgresql+psycopg2://no_such_role_3f1a:topsecret@127.0.0.1:5432/postgres",
            "the server at 127.0.0.1:5432 refused the credentials of user 'no_such_role_3f1a' "
            "(the role, its password, or pg_hba.conf)",
        ),
        (
            "postgresql+psycopg2://root:topsecret@/postgres?host=127.0.0.1:1&host=127.0.0.1:2",
            "cannot connect to the server at 127.0.0.1:1 and 127.0.0.1:2",
        ),
    ],
)
def test_submit_says_whether_the_server_the_database_or_the_credentials_are_wrong(url, says):
    """Before: a wrong database name and a wrong port both read "cannot reach the job
    database ...: OperationalError". Now the message says which, in words of our own:
    never the driver's text, never the password."""
    app = Celery("misconfigured", broker="memory://")
    leases = CeleryLease(app, url)

    @leases.job(kind="misconfigured_noop")
    def noop(ctx, payload):
        return None

    try:
        # A single submit (a prepared statement on a raw connection), a batch (a
        # transaction) and a read reach the database three ways: one message.
        for call in (lambda: noop.submit({}), lambda: noop.submit_many([{}, {}]), lambda: leases.get(str(uuid.uuid4()))):
            with pytest.raises(DatabaseUnavailable) as caught:
                call()
            text = str(caught.value)
            assert text.startswith("cannot reach the job database ") and text.endswith(f"(database_url): {says}"), text
            assert "topsecret" not in text and "FATAL" not in text and "does not exist" not in text
            assert "Connection refused" not in text and "failed:" not in text
    finally:
        leases.store.dispose()


def test_unreachable_database_stops_the_worker_with_one_clear_line(broker):
    bad = "postgresql+psycopg2://root:topsecret@127.0.0.1:1/nowhere"
    proc = subprocess.run(
        [
            CELERY,
            "-A",
            "tests.apps.app",
            "worker",
            "-P",
            "solo",
            "-l",
            "INFO",
            "--without-mingle",
            "--without-gossip",
            "--without-heartbeat",
        ],
        env=_env(bad, broker),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    line = [l for l in proc.stderr.splitlines() if l.startswith("celery-lease: cannot reach")]
    assert line, proc.stderr[-2000:]
    assert "the job database" in line[0] and "(database_url)" in line[0]
    assert "ready." not in proc.stdout + proc.stderr
    assert "topsecret" not in proc.stderr + proc.stdout


@pytest.mark.parametrize("pool", ["prefork", "solo"])
def test_batched_successes_are_written_before_the_worker_exits(pg, broker, client_app, workers, pool):
    """Plain successes wait in the completer for a batch; a warm stop must write them
    (worker_process_shutdown in a pool child, worker_shutdown in a solo worker), not
    leave them running for the reaper."""
    mod = client_app(pg, broker)
    w = workers(pg, broker, pool=pool, concurrency=1, extra_env={"CL_TEST_COMPLETION_LINGER": "60"})
    job = mod.echo.submit({"value": "held"})
    wait_for(lambda: job.id in w.log() and "succeeded in" in w.log(), timeout=20, what="the body to return")
    time.sleep(0.5)
    assert mod.leases.get(job.id).status is Status.RUNNING  # its success sits in the batch
    assert w.stop() == 0
    assert mod.leases.get(job.id).status is Status.SUCCEEDED


def test_a_plain_success_in_a_run_is_the_completers_and_logs_its_run_event(pg, broker, client_app, monkeypatch):
    """A job of a run whose success carries nothing else is written like any plain
    success, by the completer's one statement, which
    appends the run's 'succeeded' event itself. (It took the pipeline's transaction,
    three round trips, only for that event.)"""
    import uuid

    from celery.contrib.testing.worker import start_worker

    from celery_lease.db.prepared import Prepared

    executed: list[str] = []
    real_execute = Prepared.execute

    def counted(self, dbapi_connection, info, params):
        executed.append(self.prepare_sql)
        return real_execute(self, dbapi_connection, info, params)

    monkeypatch.setattr(Prepared, "execute", counted)
    mod = client_app(pg, broker, conf={"lease_prepare_statements": True})
    run_id = str(uuid.uuid4())
    with start_worker(mod.app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
        job = mod.echo.submit({"value": 1}, run_id=run_id)
        assert mod.leases.wait(job.id, 20).status is Status.SUCCEEDED
    events = [(e["event"], e["attempt"]) for e in mod.leases.run_events(run_id)]
    assert [e for e, _ in events] == ["dispatched", "claimed", "succeeded"]
    assert events[-1] == ("succeeded", 1)
    assert sum("completed_logged" in sql for sql in executed) == 1  # complete_jobs, or a claim it rode
