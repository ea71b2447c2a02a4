"""The fast submit path keeps every promise of the slow one (issue #12).

``submit_many`` is one statement whose Jobs are built from what was sent, so they must
equal the rows as stored; wakeups are published from a per-process template, so each
message must be the one ``app.send_task`` would publish, with Celery's publish signals
fired once per message, and only after the rows committed. Behaviour only: timings are
the bench's business (bench/README.md).
"""

from __future__ import annotations

import base64
import json
import os
import uuid
from datetime import timedelta

import pytest
import redis
import sqlalchemy as sa
from celery import signals
from celery._state import _task_stack

from celery_lease import Status
from celery_lease.broker.redis_direct import LPUSH_CHUNK
from celery_lease.broker.wakeups import Publisher
from celery_lease.db.prepared import Prepared
from celery_lease.db.schema import jobs
from tests.conftest import wait_for

#: These tests look at the wakeup of every job: not coalesced (waking.py).
PER_JOB = {"lease_coalesce_wakeups": False}


@pytest.fixture
def statements(monkeypatch):
    """Every SQL statement this process sends, through SQLAlchemy on any engine or as
    an EXECUTE of a prepared statement (recorded as the statement it runs)."""
    seen: list[str] = []

    def record(conn, cursor, statement, *args):
        seen.append(statement)

    real_execute = Prepared.execute

    def execute(self, dbapi_connection, info, params):
        seen.append(self.prepare_sql.split(" AS ", 1)[1])
        return real_execute(self, dbapi_connection, info, params)

    monkeypatch.setattr(Prepared, "execute", execute)
    sa.event.listen(sa.engine.Engine, "before_cursor_execute", record)
    yield seen
    sa.event.remove(sa.engine.Engine, "before_cursor_execute", record)


def writes(statements: list[str]) -> list[str]:
    """The first word of each statement but SQLite's BEGIN IMMEDIATE."""
    return [s.split()[0].upper() for s in statements if not s.startswith("BEGIN")]


@pytest.fixture(params=["postgresql", "sqlite"])
def db(request, pg_url):
    """Each test runs on PostgreSQL (the unnest statement) and SQLite (VALUES rows)."""
    return request.getfixturevalue("pg" if request.param == "postgresql" else "sqlite_url")


def messages(broker: str) -> list[dict]:
    """Every message waiting in any queue of the broker, oldest first, each taken off."""
    client = redis.Redis.from_url(broker)
    out = []
    for key in sorted(client.keys()):
        if client.type(key) == b"list":
            while (raw := client.rpop(key)) is not None:
                out.append({"queue": key.decode(), **json.loads(raw)})
    return out


def comparable(message: dict) -> dict:
    """A message without what differs between two publishes of the same wakeup."""
    message = json.loads(json.dumps(message))
    message["properties"].pop("delivery_tag")
    return message


# --- submit_many: one statement, and the jobs it returns are the rows it stored ----------


def test_submit_many_is_one_statement_returning_the_rows_as_stored(db, broker, client_app, statements):
    mod = client_app(db, broker, conf=PER_JOB)
    payloads = [{"i": i, "pair": (i, "b"), "text": "żółw ✓", "nested": {"z": 1, "a": [None, True]}} for i in range(300)]
    statements.clear()
    created = mod.echo.submit_many(payloads, tenant="acme", queue="celery")
    # One INSERT (SQLite's engine also says BEGIN IMMEDIATE).
    assert writes(statements) in (["INSERT"], ["WITH"])
    assert len({j.id for j in created}) == 300
    for job in created:
        assert job == mod.leases.get(job.id)
    assert created[7].payload == {"i": 7, "pair": [7, "b"], "text": "żółw ✓", "nested": {"z": 1, "a": [None, True]}}
    assert len(messages(broker)) == 300


def test_a_single_submit_is_one_statement_with_its_event_on_postgresql(pg, broker, client_app, statements):
    """The row and, in a run, its dispatched event go in one round trip, committed before
    the wakeup. A job outside a run of a kind that is not fair is one INSERT that opens
    neither the events table nor reads a fair key (~0.1 ms of a lone submit)."""
    mod = client_app(pg, broker, conf=PER_JOB)
    run_id = str(uuid.uuid4())
    mod.echo.submit({"i": 0}, run_id=run_id)  # creates the run
    statements.clear()
    alone = mod.echo.submit({"i": 1})
    assert writes(statements) == ["INSERT"]
    assert "celery_lease_events" not in statements[0] and "fair_key" not in statements[0]
    statements.clear()
    in_run = mod.echo.submit({"i": 2}, run_id=run_id)
    # The run is checked (and created if new) first, in the same transaction.
    assert writes(statements) == ["INSERT", "SELECT", "WITH"] and "celery_lease_events" in statements[-1]
    assert [e["event"] for e in mod.leases.run_events(run_id)] == ["dispatched"] * 2
    assert [e["job_id"] for e in mod.leases.run_events(run_id)][1] == in_run.id
    for job in (alone, in_run):
        assert job == mod.leases.get(job.id)
    assert {m["headers"]["id"] for m in messages(broker)} >= {alone.id, in_run.id}


def test_submit_many_in_a_run_and_delayed_returns_the_rows_as_stored(db, broker, client_app):
    mod = client_app(db, broker, conf=PER_JOB)
    run_id = str(uuid.uuid4())
    created = mod.echo.submit_many([{"i": i} for i in range(5)], run_id=run_id, run_after=timedelta(hours=1))
    for job in created:
        assert job == mod.leases.get(job.id) and job.run_id == run_id and job.run_after is not None
    assert [e["event"] for e in mod.leases.run_events(run_id)] == ["dispatched"] * 5
    assert messages(broker) == []  # delayed: the sweeper wakes them when due


def test_submit_many_in_the_callers_transaction_returns_the_rows_as_stored(db, broker, client_app):
    mod = client_app(db, broker, conf=PER_JOB)
    engine = sa.create_engine(db)
    with engine.begin() as conn:
        created = mod.echo.submit_many([{"i": i} for i in range(4)], connection=conn)
        assert messages(broker) == []
    for job in created:
        assert job == mod.leases.get(job.id)
    assert {m["headers"]["id"] for m in messages(broker)} == {j.id for j in created}
    engine.dispose()


def test_submit_many_with_keys_inserts_only_the_new_keys(db, broker, client_app):
    mod = client_app(db, broker, conf=PER_JOB)
    first = mod.echo.submit_many([{"v": "a"}, {"v": "b"}], idempotency_keys=["a", "b"])
    messages(broker)
    again = mod.echo.submit_many([{"v": "b2"}, {"v": "c"}, {"v": "d"}], idempotency_keys=["b", "c", "d"])
    assert [j.idempotency_key for j in again] == ["b", "c", "d"]
    assert again[0] == first[1] and again[0].payload == {"v": "b"}
    for job in again:
        assert job == mod.leases.get(job.id)
    # Only the jobs this call stored are woken.
    assert sorted(m["headers"]["id"] for m in messages(broker)) == sorted([again[1].id, again[2].id])
    engine = sa.create_engine(db)
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(jobs)).scalar() == 4
    engine.dispose()


# --- wakeups: the messages send_task would publish, signals per message, after COMMIT ---


def _both_ways(mod, broker: str, task: str, queue: str | None) -> tuple[dict, dict]:
    """The same wakeup published by the Publisher and by app.send_task; both messages."""
    job_id = str(uuid.uuid4())
    Publisher(mod.app).publish([(job_id, task, queue)])
    (fast,) = messages(broker)
    mod.app.send_task(task, task_id=job_id, queue=queue, add_to_parent=False, ignore_result=True)
    (reference,) = messages(broker)
    return fast, reference


@pytest.mark.parametrize(
    "conf, queue",
    [
        ({}, None),
        ({}, "other"),
        ({"task_routes": {"tests.apps.app.echo": {"queue": "routed", "priority": 3}}}, None),
        ({"task_default_delivery_mode": "transient", "task_default_queue": "jobs"}, None),
        ({"task_send_sent_event": True}, None),  # takes send_task itself
    ],
    ids=["default", "queue", "task_routes", "defaults", "sent_event"],
)
def test_wakeup_message_is_the_one_send_task_publishes(sqlite_url, broker, client_app, conf, queue):
    mod = client_app(sqlite_url, broker, conf=conf)
    fast, reference = _both_ways(mod, broker, mod.echo.name, queue)
    assert comparable(fast) == comparable(reference)


def test_wakeup_published_inside_a_worker_task_names_its_parent(sqlite_url, broker, client_app):
    mod = client_app(sqlite_url, broker)
    parent = mod.steps
    parent.push_request(id="parent-id", root_id="root-id", called_directly=False)
    _task_stack.push(parent)
    try:
        fast, reference = _both_ways(mod, broker, mod.echo.name, None)
    finally:
        _task_stack.pop()
        parent.pop_request()
    assert fast["headers"]["parent_id"] == "parent-id" and fast["headers"]["root_id"] == "root-id"
    assert comparable(fast) == comparable(reference)


def test_wakeups_go_straight_to_redis_and_fall_back_to_kombu_when_that_fails(pg, broker, client_app, monkeypatch):
    """A default wakeup bypasses Producer.publish (one pipeline per call); when that
    pipeline fails, the same messages go through Producer.publish, retries and all."""
    import kombu.messaging

    mod = client_app(pg, broker, conf=PER_JOB)
    via_kombu: list[str] = []
    real_publish = kombu.messaging.Producer.publish

    def publish(self, body, *args, **kwargs):
        via_kombu.append(kwargs["headers"]["id"])
        return real_publish(self, body, *args, **kwargs)

    monkeypatch.setattr(kombu.messaging.Producer, "publish", publish)
    direct = mod.echo.submit_many([{"i": i} for i in range(3)])
    assert via_kombu == [] and sorted(m["headers"]["id"] for m in messages(broker)) == sorted(j.id for j in direct)

    real_execute = redis.client.Pipeline.execute

    def broken(self, *args, **kwargs):
        raise redis.ConnectionError("the pipeline's connection dropped")

    monkeypatch.setattr(redis.client.Pipeline, "execute", broken)
    fallen_back = mod.echo.submit_many([{"i": i} for i in range(3)])
    monkeypatch.setattr(redis.client.Pipeline, "execute", real_execute)
    assert via_kombu == [j.id for j in fallen_back]
    assert sorted(m["headers"]["id"] for m in messages(broker)) == sorted(j.id for j in fallen_back)
    engine = sa.create_engine(pg, poolclass=sa.NullPool)
    with engine.connect() as conn:  # published: nothing left to the sweeper
        woken = conn.execute(sa.select(jobs.c.woken_at).where(jobs.c.id.in_([j.id for j in fallen_back]))).scalars().all()
    assert len(woken) == 3 and None not in woken


class PublishLog:
    """Receivers of both publish signals; the before one checks, on a connection of its
    own, that the job's row is already committed, and adds a header of its own."""

    def __init__(self, db: str) -> None:
        self.engine = sa.create_engine(db, poolclass=sa.NullPool)
        self.before: list[str] = []
        self.after: list[str] = []
        self.uncommitted: list[str] = []

    def on_before(self, sender=None, headers=None, body=None, properties=None, **_):
        job_id = headers["id"]
        self.before.append(job_id)
        with self.engine.connect() as conn:
            if conn.execute(sa.select(sa.func.count()).select_from(jobs).where(jobs.c.id == job_id)).scalar() != 1:
                self.uncommitted.append(job_id)
        headers["x-trace"] = f"trace-{job_id}"
        body[2]["note"] = "set by a receiver"

    def on_after(self, sender=None, headers=None, **_):
        self.after.append(headers["id"])


@pytest.fixture
def publish_log(db):
    log = PublishLog(db)
    signals.before_task_publish.connect(log.on_before, weak=False)
    signals.after_task_publish.connect(log.on_after, weak=False)
    yield log
    signals.before_task_publish.disconnect(log.on_before)
    signals.after_task_publish.disconnect(log.on_after)
    log.engine.dispose()


@pytest.mark.parametrize("how", ["submit", "submit_many", "transaction"])
def test_publish_signals_fire_once_per_wakeup_after_the_commit(db, broker, client_app, publish_log, how):
    mod = client_app(db, broker, conf=PER_JOB)
    if how == "submit":
        created = [mod.echo.submit({"i": i}) for i in range(3)]
    elif how == "submit_many":
        created = mod.echo.submit_many([{"i": i} for i in range(40)])
    else:
        engine = sa.create_engine(db)
        with engine.begin() as conn:
            created = mod.echo.submit_many([{"i": i} for i in range(5)], connection=conn)
        engine.dispose()
    ids = [j.id for j in created]
    assert publish_log.before == ids and publish_log.after == ids
    assert publish_log.uncommitted == []
    sent = messages(broker)
    assert sorted(m["headers"]["id"] for m in sent) == sorted(ids)
    for m in sent:
        # What the receiver changed is what was sent.
        assert m["headers"]["x-trace"] == f"trace-{m['headers']['id']}"
        args, kwargs, embed = json.loads(base64.b64decode(m["body"]))
        assert (args, kwargs, embed["note"]) == ([], {}, "set by a receiver")


def test_submit_many_pipelines_its_wakeups(pg, broker, client_app, monkeypatch):
    """2,500 wakeups reach Redis in a few pipelined round trips, not one each, and a
    few commands (one LPUSH per queue and chunk of messages)."""
    mod = client_app(pg, broker, conf=PER_JOB)
    executed: list[int] = []  # messages per pipeline
    commands: list[int] = []  # commands per pipeline
    real_execute = redis.client.Pipeline.execute

    def counted(self, *args, **kwargs):
        executed.append(sum(len(command) - 2 for command, _ in self.command_stack))  # LPUSH key message...
        commands.append(len(self.command_stack))
        return real_execute(self, *args, **kwargs)

    monkeypatch.setattr(redis.client.Pipeline, "execute", counted)
    mod.echo.submit_many([{"i": i} for i in range(2500)])
    mod.echo.submit_many([{"i": i} for i in range(10)])
    assert sum(executed) >= 2510 and len(executed) <= 4
    assert sum(commands) <= 2510 // LPUSH_CHUNK + 2, commands
    sent = messages(broker)
    assert len(sent) == 2510
    # Delivery tags (kombu's unacked-message keys) stay unique UUID4 strings, across calls too.
    tags = [m["properties"]["delivery_tag"] for m in sent]
    assert len(set(tags)) == len(tags) and all(uuid.UUID(t).version == 4 for t in tags)


def test_jobs_woken_by_the_fast_path_run_on_a_worker(pg, broker, client_app, workers):
    mod = client_app(pg, broker, conf=PER_JOB)
    many = mod.echo.submit_many([{"value": i} for i in range(30)])
    one = mod.echo.submit({"value": "single"})
    workers(pg, broker)
    for job in [*many, one]:
        done = mod.leases.wait(job.id, 30)
        assert done.status is Status.SUCCEEDED
    assert mod.leases.get(one.id).result["echo"] == "single"


def test_a_publisher_rebuilds_its_templates_in_a_forked_process(sqlite_url, broker, client_app):
    """The template's origin header names the process: a child must not reuse the parent's."""
    mod = client_app(sqlite_url, broker)
    publisher = Publisher(mod.app)
    publisher.publish([(str(uuid.uuid4()), mod.echo.name, None)])
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        try:
            publisher.publish([(str(uuid.uuid4()), mod.echo.name, None)])
        except BaseException:
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    wait_for(lambda: len(redis.Redis.from_url(broker).lrange("celery", 0, -1)) == 2, what="both wakeups")
    origins = [m["headers"]["origin"] for m in messages(broker)]
    assert len(set(origins)) == 2


def test_a_prepared_submit_is_planned_once_per_connection(pg):
    """Left to choose, PostgreSQL planned a fair kind's INSERT anew at every EXECUTE (a
    custom plan: the fair key's subqueries make the generic one look dearer), about 0.08
    ms of a submit's 0.6. It is marked planned_once: no EXECUTE makes a custom plan."""
    from celery_lease.db.statements.submit import insert_shared_jobs

    statement = Prepared(insert_shared_jobs(on_key_conflict_nothing=False, fair=True, in_run=False))
    shared = {
        **dict.fromkeys(("run_id", "parent_id", "tenant", "canvas", "held", "trace_context", "due_in", "due_at")),
        **dict(kind="k", task="t", queue="celery", status="pending", attempt=0, max_attempts=1, lease_seconds=60),
        **dict(lease_generation=0, lease_losses=0, priority=0, fair=True),
    }
    engine = sa.create_engine(pg)
    raw = engine.raw_connection()
    conn = raw.dbapi_connection
    conn.autocommit = True
    try:
        info: dict = {}
        for _ in range(12):  # PostgreSQL weighs a generic plan after five custom ones
            jobs_ = json.dumps([{"id": str(uuid.uuid4()), "payload": {}}])
            _, rows = statement.execute(conn, info, {**shared, "jobs": jobs_})
            assert len(rows) == 1
        with conn.cursor() as cur:
            cur.execute("SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE name = %s", (statement.name,))
            assert cur.fetchall() == [(12, 0)]
    finally:
        raw.close()
        engine.dispose()
