"""The producer boundary: bad input is refused at submit and stores nothing;
transactional enqueue publishes only after COMMIT; configuration errors are clear; and
submits keep the lease promise under a fast clock, many threads and a lost reply."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from datetime import datetime

import pytest
import redis
import sqlalchemy as sa
from celery import Celery

from celery_lease import CeleryLease, ConfigurationError, InvalidPayload, Status, UnknownKind
from celery_lease.broker import waking
from celery_lease.db.schema import jobs
from celery_lease.errors import DatabaseUnavailable
from tests.conftest import CELERY, ROOT, _env, row, wait_for
from tests.harness import faketime


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
    # INSERT ... RETURNING (outside a run: no dispatched event to insert beside it)
    assert len(statements) == 1 and statements[0].lstrip().upper().startswith("INSERT")
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
    real_execute, real_run = Prepared.execute, Prepared.run

    def counted(self, dbapi_connection, info, params):
        if "renewable" in self.prepare_sql:  # (a renewal: see below)
            return real_execute(self, dbapi_connection, info, params)
        executed.append(self.prepare_sql.split(" AS ", 1)[1].split()[0].upper())
        if threading.get_ident() == main:
            executed_here.append(executed[-1])
        return real_execute(self, dbapi_connection, info, params)

    def counted_run(self, conn, params):  # in the caller's transaction (the completion's Landing)
        executed.append(self.prepare_sql.split(" AS ", 1)[1].split()[0].upper())
        return real_run(self, conn, params)

    main = threading.get_ident()
    # The job's delivery holds its wakeup's mark (its kind ran one short job here): on a
    # loaded machine its body could outlast the mark's lifetime, which costs one claim
    # more (broker/waking.py). That is not the steady state counted here.
    monkeypatch.setattr(waking, "HOLD_TTL_MS", 60_000)
    monkeypatch.setattr(Prepared, "execute", counted)
    monkeypatch.setattr(Prepared, "run", counted_run)
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
    # The waits' SELECTs are the test's own polling, not the job's cost; a PREPARE is
    # once per pooled connection (the completion's transaction may take a fresh one).
    # A renewal is the heartbeat's, a statement per lease period and not per job; one may
    # come from a lease another test of this process left held (seen twice: 4, not 3).
    counted = [
        s
        for s in during
        if "renewable" not in s
        and (not s.lstrip().upper().startswith(("SELECT", "PREPARE")) or s.lstrip().upper().startswith("WITH"))
    ]
    cost = [s.split()[0].upper() for s in counted]
    assert submitted == ["INSERT"]  # the row (in a run, with its event: one WITH statement)
    # submit; claim; completion (these two + their run events, in one statement each)
    assert sorted(cost + executed) == ["INSERT", "WITH", "WITH"], ([" ".join(s.split())[:120] for s in counted], executed)
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
    real_execute, real_run = Prepared.execute, Prepared.run

    def counted(self, dbapi_connection, info, params):
        executed.append(self.prepare_sql)
        return real_execute(self, dbapi_connection, info, params)

    def counted_run(self, conn, params):  # in a transaction of the caller's (the pipeline's)
        executed.append(self.prepare_sql)
        return real_run(self, conn, params)

    monkeypatch.setattr(Prepared, "execute", counted)
    monkeypatch.setattr(Prepared, "run", counted_run)
    mod = client_app(pg, broker, conf={"lease_prepare_statements": True})
    run_id = str(uuid.uuid4())
    with start_worker(mod.app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
        job = mod.echo.submit({"value": 1}, run_id=run_id)
        assert mod.leases.wait(job.id, 20).status is Status.SUCCEEDED
    events = [(e["event"], e["attempt"]) for e in mod.leases.run_events(run_id)]
    assert [e for e, _ in events] == ["dispatched", "claimed", "succeeded"]
    assert events[-1] == ("succeeded", 1)
    assert sum("ended_logged" in sql for sql in executed) == 1  # the completer's end_jobs


def seconds_from_db_now(db, value) -> float:
    with db.connect() as conn:
        return conn.execute(sa.select(sa.func.extract("epoch", sa.literal(value) - sa.func.now()))).scalar()


# --- clocks (item 9) ------------------------------------------------------------------------


@pytest.mark.skipif(not faketime.available(), reason="needs libfaketime and a C compiler (bash dev.sh test installs them)")
def test_a_submitting_host_an_hour_fast_moves_no_due_or_wakeup_time(pg, broker, redis_server, client_app, db):
    """woken_at and a relative run_after come from the database's clock: a host an
    hour fast used to stamp woken_at an hour ahead, hiding a lost wakeup from the
    sweeper for an hour, and to push a 2 s delay an hour out."""
    script = textwrap.dedent(
        """
        import json
        from tests.apps.app import echo
        now = echo.submit({"value": "now"})
        later = echo.submit({"value": "later"}, run_after=2)
        many = echo.submit_many([{"value": 1}, {"value": 2}], run_after=2)
        print(json.dumps([now.id, later.id] + [j.id for j in many]))
        """
    )
    env = faketime.skewed_env("+1h", _env(pg, broker))
    out = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    now_id, *delayed = json.loads(out.stdout.strip().splitlines()[-1])
    assert abs(seconds_from_db_now(db, row(db, now_id)["woken_at"])) < 60
    for job_id in delayed:
        r = row(db, job_id)
        assert r["woken_at"] is None
        assert 0 < seconds_from_db_now(db, r["run_after"]) < 60

    # The wakeup of the job due now is lost; the sweeper re-sends it once stale by the
    # database's clock (2 s here), not an hour later.
    redis_server.flush()
    mod = client_app(pg, broker, conf={"lease_sweep_stale_seconds": 1})
    swept: list[str] = []

    def sweep_all() -> bool:
        swept.extend(str(r["id"]) for r in mod.leases.store.claim_due_wakeups(1, 100))
        return set(swept) >= {now_id, *delayed}

    wait_for(sweep_all, timeout=20, interval=0.25, what="the sweeper to re-send every wakeup")


def test_a_web_app_submitting_from_many_threads_does_not_exhaust_the_pool(pg, broker, client_app, db):
    """Submits from 40 threads at once, in a process that is not a worker: each thread
    used to pin a pooled connection for its prepared INSERT, and the 13th waited 30 s
    for one of the 12 and failed. Outside a worker the pool lends one per statement."""
    mod = client_app(pg, broker)
    errors: list[BaseException] = []
    start, done = threading.Barrier(40), threading.Barrier(40)

    def submit_five():
        # Like a web server's request threads: they live on after a request.
        start.wait()
        try:
            for i in range(5):
                mod.echo.submit({"value": i})
        except BaseException as exc:  # reported below, with its type
            errors.append(exc)
        done.wait(timeout=90)

    threads = [threading.Thread(target=submit_five) for _ in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    with db.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(jobs)).scalar() == 200


# --- lost replies (item 7) ---------------------------------------------------------------------


@pytest.fixture
def proxy(pg_proxy):
    """A TCP proxy in front of the shared PostgreSQL, that the test may freeze or cut."""
    return pg_proxy


def _jobs_with_payload(db, value: str) -> list[str]:
    with db.connect() as conn:
        return [str(r[0]) for r in conn.execute(sa.select(jobs.c.id).where(jobs.c.payload["value"].as_string() == value))]


@pytest.mark.parametrize("how", ["single", "keyed", "run"])
def test_a_submit_whose_reply_was_lost_is_retried_without_duplicate_or_error(pg, broker, client_app, db, proxy, how):
    """The INSERT (or the COMMIT of a run's submit) reaches PostgreSQL and commits, then
    the connection drops before the reply: the retry must find what landed. (It raised
    a raw UniqueViolation for a job that existed, and callers retried and duplicated.)"""
    import uuid

    mod = client_app(proxy.url_for(pg), broker)
    marker = f"lost-reply-{uuid.uuid4().hex}"
    options: dict = {}
    if how == "keyed":
        options["idempotency_key"] = marker
    if how == "run":
        options["run_id"] = str(uuid.uuid4())
        proxy.cut_reply_to(b"COMMIT")  # the run, the row and its event commit together
    else:
        proxy.cut_reply_to(marker.encode())
    job = mod.echo.submit({"value": marker}, **options)
    assert proxy.cuts == 1  # the reply really was lost
    assert _jobs_with_payload(db, marker) == [job.id]
    assert mod.leases.get(job.id).status.value == "pending"
    if how == "run":
        events = mod.leases.run_events(options["run_id"])
        assert [e["event"] for e in events] == ["dispatched"]  # logged once, by the try that landed
