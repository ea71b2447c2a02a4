"""A transition whose COMMIT landed but whose reply was lost (#18, reasoned items).

The connection drops right after the server committed: the client cannot tell. Before,
the transaction was simply run again, matched nothing (the job had already moved), and
everything the first try set off after its commit was skipped: the cancel reported
False, the plain errback was never applied, the leased errback never woken, the slot
never freed. Now the server is asked (celery_lease/db/landing.py) and the follow-ups of
the try that landed run exactly once.

The fault is injected in this process's driver: the real COMMIT runs on the real
server, then the connection is closed and the driver raises as on a dropped socket.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import psycopg2
import pytest
import sqlalchemy as sa

from celery_lease.beat.maintenance import OUTBOX_AGE
from celery_lease.db.landing import LANDING_RETENTION
from celery_lease.db.schema import jobs, landings, outbox
from celery_lease.db.statements.outbox import KIND_CELERY
from tests.conftest import wait_for
from tests.integration.test_native_canvas import NATIVE, _expire, _queued, _rows, in_a_run_cancelled_behind_it


@contextlib.contextmanager
def reply_lost_once(engine) -> Iterator[list[int]]:
    """The next COMMIT on ``engine`` lands, and its reply is lost. Yields a list that
    counts the commits that lost their reply."""
    dialect = engine.dialect
    original = dialect.do_commit
    lost: list[int] = []

    def do_commit(dbapi_connection):
        original(dbapi_connection)
        if not lost:
            lost.append(1)
            dbapi_connection.close()
            raise psycopg2.OperationalError("server closed the connection unexpectedly")

    dialect.do_commit = do_commit
    try:
        yield lost
    finally:
        dialect.do_commit = original


def test_a_cancel_and_a_reap_whose_reply_was_lost_fire_their_errbacks_once(pg, broker, client_app, tmp_path):
    mod = client_app(pg, broker, module=NATIVE)

    def with_errbacks(n: int, **options):
        return mod.inc.apply_async(({"n": n},), link_error=[mod.noted_error.s(), mod.plain_errback.s(str(tmp_path))], **options)

    def errbacks_of(job_id: str) -> list[dict]:
        return _rows(pg, jobs.c.kind == "noted_error", jobs.c.parent_id == job_id)

    def woken(messages: list[dict]) -> list[str]:
        return [m["headers"]["id"] for m in messages if m["headers"]["task"] == mod.noted_error.name]

    # A cancel: reported done, its errbacks applied and woken once.
    pending = with_errbacks(1, countdown=600)
    _queued(broker)
    with reply_lost_once(mod.leases.store.durable) as lost:
        assert mod.leases.cancel(pending.id) is True
    assert lost == [1]
    (errback,) = errbacks_of(pending.id)
    messages = _queued(broker)
    assert woken(messages) == [str(errback["id"])]
    plain = [m for m in messages if m["headers"]["task"] == "tests.plain_errback"]
    assert len(plain) == 1

    # A reap of a job with no attempt left: expired, errbacks once, counted once.
    running = with_errbacks(2)
    _expire(pg, running.id)
    _queued(broker)
    with reply_lost_once(mod.leases.store.durable) as lost:
        assert mod.leases.reap() == {"requeued": 0, "expired": 1}
    assert lost == [1]
    (errback,) = errbacks_of(running.id)
    assert errback["payload"] == {"job_id": running.id, "error": "lease expired"}
    messages = _queued(broker)
    assert woken(messages) == [str(errback["id"])]
    assert len([m for m in messages if m["headers"]["task"] == "tests.plain_errback"]) == 1


def test_a_cancel_whose_reply_was_lost_frees_the_slot_of_its_limited_job(pg, broker, client_app):
    """``concurrency=1``: A runs, B is held by the limit. A's cancel lands, its reply is
    lost: B is woken, once (before: the retry matched nothing, freed nothing, and B
    waited for the sweeper's recovery)."""
    mod = client_app(pg, broker, module="tests.apps.app_flow")
    spec = mod.leases.registry.resolve("one_slot")
    a, b = (mod.one_slot.submit({"n": n}) for n in (1, 2))
    assert mod.leases.flow.claim(a.id, spec, "test/1/boot") is not None
    assert mod.leases.flow.claim(b.id, spec, "test/1/boot") is None  # held by the limit
    assert _rows(pg, jobs.c.id == b.id)[0]["held"] == "limit"
    _queued(broker)
    with reply_lost_once(mod.leases.store.durable) as lost:
        assert mod.leases.cancel(a.id) is True
    assert lost == [1]
    woken = [m["headers"]["id"] for m in _queued(broker) if m["headers"]["task"] == mod.one_slot.name]
    assert woken == [b.id]
    assert _rows(pg, jobs.c.id == b.id)[0]["held"] is None


def test_a_claim_time_cancel_whose_errbacks_reply_was_lost_fires_them_once(pg, broker, client_app, tmp_path):
    """A job its claim finds in a cancelled run is cancelled by the claim; its errbacks
    are the claim's follow-up, written after the claim committed. That write's reply is
    lost: it is settled by asking the server (a Landing), not written again (before: a
    second errback job and a second plain errback)."""
    mod = client_app(pg, broker, module=NATIVE)
    job = in_a_run_cancelled_behind_it(mod, pg, broker, tmp_path)
    with reply_lost_once(mod.leases.store.durable) as lost:
        assert mod.leases.worker.begin(job.id, mod.inc.spec, "w@host") is None  # cancelled, not started
    assert lost == [1]
    (errback,) = _rows(pg, jobs.c.kind == "noted_error", jobs.c.parent_id == job.id)
    assert errback["payload"] == {"job_id": job.id, "error": "cancelled"}
    plain = [m for m in _queued(broker) if m["headers"]["task"] == "tests.plain_errback"]
    assert len(plain) == 1


def _all(pg: str, table: sa.Table) -> list[dict]:
    engine = sa.create_engine(pg)
    try:
        with engine.connect() as conn:
            return [dict(r) for r in conn.execute(sa.select(table)).mappings()]
    finally:
        engine.dispose()


def test_what_a_transition_leaves_behind_is_sent_or_pruned(pg, broker, client_app, tmp_path):
    """A plain errback whose commit was heard is sent by its writer and its outbox row
    deleted (the sweep does not send it again); one left in the outbox (its writer never
    heard the commit) is sent by the sweep after OUTBOX_AGE, once; a Landing's marker
    rows are pruned after LANDING_RETENTION."""
    mod = client_app(pg, broker, module=NATIVE)
    job = mod.inc.apply_async(({"n": 1},), countdown=600, link_error=[mod.plain_errback.s(str(tmp_path))])
    _queued(broker)
    assert mod.leases.cancel(job.id) is True
    assert [m["headers"]["task"] for m in _queued(broker)] == ["tests.plain_errback"]
    assert _all(pg, outbox) == []
    assert len(_all(pg, landings)) == 1  # the cancel's

    # A follow-up whose writer did not send it: the sweep sends it once it is old enough.
    payload = {"sig": dict(mod.plain_errback.s(str(tmp_path))), "args": [job.id], "options": {}}
    left = mod.leases.store.transaction(
        mod.leases.store.durable, lambda conn: mod.leases.store.write_outbox(conn, KIND_CELERY, [payload])
    )
    mod.leases.sweep()
    assert _queued(broker) == []  # younger than OUTBOX_AGE: still its writer's to send
    _age(pg, "celery_lease_outbox", OUTBOX_AGE + 1)
    mod.leases.sweep()
    assert [(m["headers"]["task"], m["headers"]["id"] is not None) for m in _queued(broker)] == [("tests.plain_errback", True)]
    assert len(left) == 1 and _all(pg, outbox) == []  # sent, then deleted
    mod.leases.sweep()
    assert _queued(broker) == []

    _age(pg, "celery_lease_landings", LANDING_RETENTION + 1)
    mod.leases.prune()
    assert _all(pg, landings) == []


def test_a_transition_that_waited_on_a_lock_is_not_swept_while_its_writer_sends(pg, broker, client_app, tmp_path):
    """The cancel waits on the job's row lock longer than OUTBOX_AGE, then commits its
    plain errback's outbox row; a sweep between that commit and its writer's send (held
    up by a Redis pause of writes) leaves the row to its writer: one message."""
    import threading
    import time

    import redis

    mod = client_app(pg, broker, module=NATIVE)
    job = mod.inc.apply_async(({"n": 1},), countdown=600, link_error=[mod.plain_errback.s(str(tmp_path))])
    _queued(broker)
    engine = sa.create_engine(pg)
    client = redis.Redis.from_url(broker)
    try:
        with engine.connect() as holder:
            holder.execute(sa.select(jobs.c.id).where(jobs.c.id == job.id).with_for_update())
            cancel = threading.Thread(target=mod.leases.cancel, args=(job.id,))
            cancel.start()
            time.sleep(OUTBOX_AGE + 1)
            client.client_pause(3000, all=False)  # the writer's send waits, after its commit
            holder.commit()
        wait_for(lambda: _all(pg, outbox), timeout=10, what="the cancel's commit")
        mod.leases.sweep()
        cancel.join(timeout=30)
    finally:
        client.close()
        engine.dispose()
    assert [m["headers"]["task"] for m in _queued(broker)] == ["tests.plain_errback"]
    assert _all(pg, outbox) == []


def test_a_partly_failed_send_leaves_only_the_unsent_follow_up_to_the_sweep(pg, broker, client_app, tmp_path):
    """Three plain errbacks; the broker refuses the second (its queue's key is not a
    list): the two sent lose their outbox rows at once, and the sweep sends the third
    alone once the broker takes it."""
    import redis

    mod = client_app(pg, broker, module=NATIVE)
    errbacks = [mod.plain_errback.s(str(tmp_path)).set(queue=q) for q in ("first", "jammed", "third")]
    job = mod.inc.apply_async(({"n": 1},), countdown=600, link_error=errbacks)
    _queued(broker)
    client = redis.Redis.from_url(broker)
    try:
        client.set("jammed", "not a queue")  # LPUSH there fails: WRONGTYPE
        assert mod.leases.cancel(job.id) is True
        assert sorted(m["properties"]["delivery_info"]["routing_key"] for m in _queued(broker)) == ["first", "third"]
        assert len(_all(pg, outbox)) == 1
        client.delete("jammed")
    finally:
        client.close()
    _age(pg, "celery_lease_outbox", OUTBOX_AGE + 1)
    mod.leases.sweep()
    assert [m["properties"]["delivery_info"]["routing_key"] for m in _queued(broker)] == ["jammed"]
    assert _all(pg, outbox) == []


def _age(pg: str, table: str, seconds: float) -> None:
    engine = sa.create_engine(pg)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(f"UPDATE {table} SET created_at = created_at - make_interval(secs => :s)"), {"s": seconds})
    finally:
        engine.dispose()


@pytest.mark.parametrize("prepared", [True, False], ids=["prepared", "unprepared"])
def test_a_claim_retried_while_its_first_try_still_runs_adopts_what_that_try_claims(pg, broker, client_app, pg_proxy, prepared):
    """history[prepared] seed 639886: a delivery's claim swapped in a higher-priority
    job B (locking it) and, still running, lost its connection. Retried at once, the claim
    skipped the locked B and claimed the delivered job; the first try then committed B
    under the same owner and token, and B ran no body until the reaper spent its attempt.
    The retry now waits for the dropped connection's backend to finish (Database.
    _await_in_flight), so the claim's look at what landed finds B and adopts it."""
    import threading
    import uuid

    from celery_lease.lifecycle.claim import claim_delivery

    mod = client_app(pg_proxy.url_for(pg), broker, conf={"lease_prepare_statements": prepared})
    run_id = str(uuid.uuid4())
    delivered = mod.echo.submit({"value": "low"}).id
    better = mod.echo.submit({"value": "high"}, priority=5, run_id=run_id).id
    owner = "w@host/1/boot"
    blocker = sa.create_engine(pg, poolclass=sa.pool.NullPool)
    locker = blocker.connect()
    try:
        locked = locker.begin()
        # The first try's claim locks B (its swap) and then waits for B's run row.
        locker.execute(sa.text("SELECT id FROM celery_lease_runs WHERE id = :r FOR UPDATE"), {"r": run_id})
        got: list = []
        claim = threading.Thread(target=lambda: got.append(claim_delivery(mod.leases.store, delivered, owner, mod.echo.name)))
        claim.start()

        def waiting() -> bool:
            waits = sa.text("SELECT query FROM pg_stat_activity WHERE wait_event_type = 'Lock'")
            with blocker.connect() as conn:
                return any("celery_lease" in q for (q,) in conn.execute(waits))  # (prepared: EXECUTE celery_lease_N)

        wait_for(waiting, timeout=10, what="the claim to wait for the run's row")
        assert pg_proxy.cut_all() > 0  # its connection drops; its backend still waits
        threading.Timer(1.0, locked.commit).start()  # then the first try goes on and commits
        claim.join(timeout=30)
        (row,) = got
    finally:
        locker.close()
        blocker.dispose()
    assert row is not None and str(row["id"]) == better  # adopted: the first try's job
    with sa.create_engine(pg).connect() as conn:
        status = dict(conn.execute(sa.select(jobs.c.id, jobs.c.status).where(jobs.c.id.in_([delivered, better]))).all())
    assert {str(k): v for k, v in status.items()} == {delivered: "pending", better: "running"}


@pytest.mark.parametrize("prepared", [True, False], ids=["prepared", "unprepared"])
def test_a_claim_whose_retry_finds_the_server_recovering_is_settled_when_it_answers(pg, broker, client_app, prepared):
    """history[prepared] seed 639886: a claim landed, its connection dropped (a backend
    SIGKILLed elsewhere resets every backend), and its retry found the server refusing
    clients while it recovered. The delivery was given up with DatabaseUnavailable, and
    the claimed job ran no body until the reaper spent its attempt. Now the claim asks
    again through a short outage and adopts what its first try took."""
    from celery_lease.lifecycle.claim import claim_delivery
    from tests.harness.pgfaults import PgFaultProxy

    url = sa.engine.make_url(pg)
    proxy = PgFaultProxy(url.host or "127.0.0.1", url.port or 5432).start()
    try:
        mod = client_app(proxy.url_for(pg), broker, conf={"lease_prepare_statements": prepared})
        job = mod.echo.submit({"value": 1})
        mod.leases.store.dispose()  # the submit's connections: the claim starts afresh
        rule = proxy.lose_reply(job.id, then=lambda: proxy.refuse(0.6))  # the claim: the first statement naming it
        row = claim_delivery(mod.leases.store, job.id, "w@host/1/boot", mod.echo.name)
        assert rule.hits == 1
    finally:
        proxy.close()
    assert row is not None and str(row["id"]) == job.id and row["attempt"] == 1
    with sa.create_engine(pg).connect() as conn:
        found = conn.execute(sa.select(jobs.c.status, jobs.c.lease_owner).where(jobs.c.id == job.id)).one()
    assert tuple(found) == ("running", "w@host/1/boot")
