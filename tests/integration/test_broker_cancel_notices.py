"""Cancel notices (broker/cancel_notice.py) against real PostgreSQL and Redis: parsed,
scoped to one app and database, acted on for held jobs only, and at a bounded rate."""

from __future__ import annotations

import json
import threading
import time
import uuid

import redis
import sqlalchemy as sa

from celery_lease.broker import cancel_notice
from celery_lease.db.store import Store
from celery_lease.worker.heartbeat import Heartbeat
from tests.conftest import attempt_for, wait_for

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
