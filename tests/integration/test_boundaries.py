"""Boundaries against real PostgreSQL and Redis (issue 10): what submit refuses, what a
refused batch of successes does, what cancel notices a worker acts on, and what the
operator's terminal is shown."""

from __future__ import annotations

import json
import subprocess
import threading
import time
import uuid

import pytest
import redis
import sqlalchemy as sa

from celery_lease import InvalidPayload, Status
from celery_lease.broker import cancel_notice
from celery_lease.db.schema import jobs
from celery_lease.db.store import Store
from celery_lease.payload import Codec
from celery_lease.worker.completion import UNSTORABLE_RESULT, BackgroundCompleter
from celery_lease.worker.heartbeat import Heartbeat
from tests.conftest import CELERY, ROOT, _env, attempt_for, local_pipeline, wait_for

SECRET = "s3cr3t-payload-7731"


def count_jobs(url: str) -> int:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return conn.execute(sa.select(sa.func.count()).select_from(jobs)).scalar()
    finally:
        engine.dispose()


def queued(broker: str) -> int:
    return redis.Redis.from_url(broker).llen("celery")


def _refused(exc: BaseException) -> str:
    """The text a caller's log would show of an exception, cause and context included."""
    parts, seen = [], exc
    while seen is not None:
        parts.append(f"{type(seen).__name__}: {seen}")
        seen = seen.__cause__ or (None if seen.__suppress_context__ else seen.__context__)
    return "\n".join(parts)


# --- submit: values the table cannot hold are refused, without echoing the payload -------


@pytest.mark.parametrize(
    "payload, options, says",
    [
        ({"token": SECRET, "x": "a\x00b"}, {}, "payload contains a NUL character"),
        ({"token": SECRET, "k\x00": 1}, {}, "payload contains a NUL character"),
        ({"token": SECRET, "x": "lone \udc80"}, {}, "payload contains a lone surrogate"),
        ({"token": SECRET}, {"idempotency_key": "k" * 5000}, "idempotency_key is 5000 characters, over the limit of 255"),
        ({"token": SECRET}, {"idempotency_key": f"{SECRET}\x00"}, "idempotency_key contains a NUL character"),
        ({"token": SECRET}, {"idempotency_key": SECRET.encode()}, "idempotency_key must be a string, not bytes"),
        ({"token": SECRET}, {"tenant": 42}, "tenant must be a string, not int"),
        ({"token": SECRET}, {"tenant": ["acme"]}, "tenant must be a string, not list"),
        ({"token": SECRET}, {"tenant": "t" * 201}, "tenant is 201 characters, over the limit of 200"),
        ({"token": SECRET}, {"queue": "q" * 201}, "queue is 201 characters, over the limit of 200"),
        ({"token": SECRET}, {"run_id": SECRET}, "run_id must be a UUID"),
        ({"token": SECRET}, {"run_after": float("nan")}, "run_after is out of range"),
        ({"token": SECRET}, {"run_after": 1e300}, "run_after is out of range"),
        (
            {"token": SECRET, "x": json.loads("[" * 400 + "1" + "]" * 400)},
            {},
            "payload nests lists and objects 401 levels deep, over the limit of 100",
        ),
    ],
)
def test_submit_refuses_what_the_table_cannot_hold_without_echoing_it(pg, broker, client_app, payload, options, says):
    """Before: raw driver errors (DataError, ValueError, UnicodeEncodeError) whose text
    held the whole INSERT, payload included, or a ValueError quoting the run id."""
    mod = client_app(pg, broker)
    with pytest.raises(InvalidPayload) as caught:
        mod.echo.submit(payload, **options)
    text = _refused(caught.value)
    assert says in text and SECRET not in text, text
    assert count_jobs(pg) == 0 and queued(broker) == 0


def test_submit_many_refuses_bad_keys_before_storing_any(pg, broker, client_app):
    mod = client_app(pg, broker)
    for keys, says in (
        (["ok", "x" * 256], "idempotency_key is 256 characters"),
        (["ok", None], "idempotency_key must be a string, not NoneType"),
        ("ab", "must be a list of keys"),  # a string would be two keys of one character
    ):
        with pytest.raises(InvalidPayload, match=says):
            mod.echo.submit_many([{}, {}], idempotency_keys=keys)
    assert count_jobs(pg) == 0
    # Ints and UUIDs are spelt as strings, as before.
    key = uuid.uuid4()
    a, b = mod.echo.submit_many([{}, {}], idempotency_keys=[7, key])
    assert (a.idempotency_key, b.idempotency_key) == ("7", str(key))


def test_validation_errors_describe_the_input_without_quoting_it(pg, broker, client_app):
    """pydantic's own text carries ``input_value=...``: the submitted value itself."""
    mod = client_app(pg, broker)
    with pytest.raises(InvalidPayload) as caught:
        mod.typed_pd.submit({"sku": "A-1", "quantity": SECRET})
    text = _refused(caught.value)
    assert "quantity" in text and "integer" in text and SECRET not in text, text
    assert count_jobs(pg) == 0


def test_a_value_the_database_refuses_is_never_reported_with_the_drivers_text(pg, broker, client_app, monkeypatch):
    """The last line of defence: should a value get past the checks, the driver's
    refusal (its text is the whole INSERT) still reaches the caller as InvalidPayload."""
    mod = client_app(pg, broker)
    monkeypatch.setattr(Codec, "dump_payload", lambda self, payload, max_bytes=0: payload)  # no checks at all
    for prepare in (True, False):
        mod.leases.store._prepared = None if not prepare else mod.leases.store._prepared
        with pytest.raises(InvalidPayload) as caught:
            mod.echo.submit({"token": SECRET, "x": "a\x00b"})
        text = _refused(caught.value)
        assert "the job database refused a value of this job" in text and SECRET not in text, text
    assert count_jobs(pg) == 0


# --- a refused batch of successes is written row by row ---------------------------------


def test_a_refused_batch_of_successes_is_retried_row_by_row(pg, make_job):
    """Before: one value PostgreSQL refuses dropped the whole batch (every job left
    running, although Celery had reported each one's success)."""
    store = Store(pg)
    try:
        ids = [
            make_job(pg, status="running", attempt=1, lease_generation=1, lease_expires_at=sa.text("now() + interval '1 hour'"))
            for _ in range(4)
        ]
        attempts = [attempt_for(i) for i in ids]
        completer = BackgroundCompleter(store, local_pipeline(store))
        completer.LINGER = 5.0  # one batch: flush() ends it
        for n, attempt in enumerate(attempts):
            # The third result holds NUL, which jsonb refuses (it passed no codec here).
            completer.add(attempt, {"n": n, "note": "a\x00b" if n == 2 else "fine"}, None)
        completer.flush()
        engine = sa.create_engine(pg)
        with engine.connect() as conn:
            rows = {str(r.id): r for r in conn.execute(sa.select(jobs.c.id, jobs.c.status, jobs.c.result, jobs.c.error))}
        engine.dispose()
        assert [rows[i].status for i in ids] == ["succeeded", "succeeded", "failed", "succeeded"]
        assert [rows[i].result for i in ids] == [
            {"n": 0, "note": "fine"},
            {"n": 1, "note": "fine"},
            None,
            {"n": 3, "note": "fine"},
        ]
        assert rows[ids[2]].error == UNSTORABLE_RESULT
    finally:
        store.dispose()


# --- cancel notices: parsed, scoped, for held jobs only, rate-bound ----------------------


class _Renewals:
    """Counts the renewal statements this process sends for one job."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.count = 0

    def __call__(self, conn, cursor, statement, parameters, *args) -> None:
        # An UPDATE of lease_expires_at, alone or inside a CTE (PostgreSQL's renewal
        # skips rows locked by this process's own transactions: WITH ... UPDATE).
        renewal = (
            "UPDATE celery_lease_jobs" in statement.upper().replace("UPDATE CELERY_LEASE_JOBS", "UPDATE celery_lease_jobs")
            and "lease_expires_at" in statement
        )
        if renewal and self.job_id in str(parameters):
            self.count += 1


def test_forged_cancel_notices_cost_no_renewal_statement(pg, broker, make_job):
    """Before: every message on the shared channel made every worker process run a
    renewal statement, whatever it said, from any app or Redis database."""
    held = make_job(
        pg,
        status="running",
        attempt=1,
        lease_generation=1,
        lease_seconds=300,
        lease_expires_at=sa.text("now() + interval '300 seconds'"),
    )
    store = Store(pg, prepare_statements=False)
    renewals = _Renewals(held)
    sa.event.listen(sa.engine.Engine, "before_cursor_execute", renewals)
    channel = cancel_notice.channel(broker, "tests")
    heartbeat = Heartbeat(store, broker, channel)
    # A 300 s lease: the heartbeat's own next round is 100 s away.
    attempt = attempt_for(held, lease_seconds=300)
    client = redis.Redis.from_url(broker)
    # Heartbeats of earlier tests in this process may still listen on the channel.
    before = client.pubsub_numsub(channel)[0][1]
    try:
        heartbeat.add(attempt)
        wait_for(lambda: client.pubsub_numsub(channel)[0][1] == before + 1, what="the listener to subscribe")
        listener = heartbeat.notices
        assert listener is not None
        other_db = broker.rsplit("/", 1)[0] + "/5"
        forged = (
            b"not json",
            b"{}",
            json.dumps([]),
            json.dumps(["not-a-uuid"]),
            json.dumps([held.upper(), 7]),  # one bad entry spoils the notice
            json.dumps([str(uuid.uuid4()) for _ in range(50)]),  # ids held by nobody here
            json.dumps([held] * (cancel_notice.MAX_IDS + 1)),  # too many ids
            (json.dumps([held]) + " " * cancel_notice.MAX_NOTICE_BYTES).encode(),  # too long
        )
        for notice in forged:
            client.publish(channel, notice)
        # The held job's id, but another app's channel and another database's.
        cancel_notice.publish(broker, [held], cancel_notice.channel(broker, "another-app"))
        cancel_notice.publish(other_db, [held], cancel_notice.channel(other_db, "tests"))
        # A genuine notice, published after the others: Redis delivers in order, so once
        # it is received, every notice before it has been handled.
        cancel_notice.publish(broker, [held], channel)
        wait_for(lambda: listener.received == len(forged) + 1, timeout=20, what="the notices to be handled")
        wait_for(lambda: renewals.count >= 1, timeout=20, what="the genuine notice's renewal")
        assert (listener.ignored, listener.dropped, listener.woken) == (len(forged), 0, 1)
        assert renewals.count == 1
    finally:
        heartbeat.remove(attempt)
        sa.event.remove(sa.engine.Engine, "before_cursor_execute", renewals)
        store.dispose()


def test_cancel_notices_wake_the_heartbeat_at_a_bounded_rate(broker):
    held = str(uuid.uuid4())
    wakes = []
    channel = cancel_notice.channel(broker, "rate")
    client = redis.Redis.from_url(broker)
    before = client.pubsub_numsub(channel)[0][1]
    listener = cancel_notice.listen(broker, lambda: wakes.append(1), held=lambda: {held}, channel_name=channel)
    wait_for(lambda: client.pubsub_numsub(channel)[0][1] == before + 1, what="the listener to subscribe")
    started = time.monotonic()
    pipe = client.pipeline()
    for _ in range(1000):
        pipe.publish(channel, json.dumps([held]))
    pipe.execute()
    wait_for(lambda: listener.received == 1000, timeout=30, what="every notice received")
    elapsed = time.monotonic() - started
    assert 1 <= listener.woken == len(wakes) <= cancel_notice.WAKE_BURST + cancel_notice.WAKE_RATE * elapsed + 1
    assert listener.dropped == 1000 - listener.woken


def test_cancel_reaches_a_listener_of_the_same_app_and_database(broker):
    """The genuine path still works: leases.cancel's notice is on the app's channel."""
    held = str(uuid.uuid4())
    event = threading.Event()
    channel = cancel_notice.channel(broker, "tests")
    client = redis.Redis.from_url(broker)
    # Listeners of earlier tests in this process may be on the channel still (a fresh-clone
    # run published before this one had subscribed, and the notice was never seen).
    before = client.pubsub_numsub(channel)[0][1]
    listener = cancel_notice.listen(broker, event.set, held=lambda: {held}, channel_name=channel)
    wait_for(lambda: client.pubsub_numsub(channel)[0][1] == before + 1, what="the listener to subscribe")
    assert cancel_notice.publish(broker, [str(uuid.uuid4()), held], cancel_notice.channel(broker, "tests"))
    assert event.wait(10) and listener.woken == 1


# --- the operator's terminal -------------------------------------------------------------


def test_lease_show_escapes_control_characters(pg, broker, make_job):
    """Before, `lease show` printed job data raw: an error or a kind holding escape
    sequences could rewrite the operator's terminal."""
    nasty = "\x1b]0;owned\x07\x1b[2J\rfake line\u202e"
    job = make_job(pg, status="failed", error=f"boom {nasty}", result={"k": nasty}, tenant=nasty, finished_at=sa.func.now())
    proc = subprocess.run(
        [CELERY, "-A", "tests.apps.app", "lease", "show", job],
        env=_env(pg, broker),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for ch in "\x1b\x07\r\u202e":
        assert ch not in out
    assert "boom \\x1b]0;owned\\x07\\x1b[2J\\rfake line\\u202e" in out
    listed = subprocess.run(
        [CELERY, "-A", "tests.apps.app", "lease", "list"],
        env=_env(pg, broker),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert listed.returncode == 0 and "\x1b" not in listed.stdout and "boom \\x1b" in listed.stdout
    assert Status.FAILED.value in listed.stdout
