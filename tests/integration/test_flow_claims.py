"""Flow control's claim and release on PostgreSQL, statement by statement: each test
sets rows up directly (make_job) and runs the store's transactions as a worker does."""

from __future__ import annotations

from datetime import datetime

import pytest
import sqlalchemy as sa

from celery_lease.db.schema import jobs, limits
from celery_lease.flow.limits import Limits, Rate
from celery_lease.lifecycle.claim import claim_delivery
from celery_lease.status import Held

OWNER = "n/1/b"


@pytest.fixture(params=[True, False], ids=["prepared", "unprepared"])
def flow(request, pg):
    from celery_lease.db.store import Store
    from celery_lease.flow.store import FlowStore

    store = Store(pg, prepare_statements=request.param)
    yield FlowStore(store)
    store.dispose()


def held_jobs(pg, make_job, n: int, reason: Held, kind: str = "k") -> list[str]:
    """n pending jobs of ``kind`` held for ``reason``, inserted after the table's
    statistics were taken with none held (as autovacuum leaves them when a backlog
    builds up quickly): the planner then expects the held jobs to be few."""
    engine = sa.create_engine(pg, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.exec_driver_sql("ANALYZE celery_lease_jobs")
    engine.dispose()
    return [make_job(pg, kind=kind, task="t", held=reason.value) for _ in range(n)]


def statuses(pg, ids) -> dict[str, tuple[str, str | None]]:
    engine = sa.create_engine(pg)
    with engine.connect() as conn:
        rows = conn.execute(sa.select(jobs.c.id, jobs.c.status, jobs.c.held).where(jobs.c.id.in_(ids))).all()
    engine.dispose()
    return {str(r.id): (r.status, r.held) for r in rows}


def test_one_freed_slot_wakes_one_of_200_held_jobs(pg, make_job, flow):
    """concurrency=1, one job held by the limit for each of 200: a release with the slot
    free wakes exactly one (the `id IN (SELECT ... LIMIT ... SKIP LOCKED)` plan woke 199)."""
    limits_ = Limits(concurrency=1)
    first = make_job(pg, kind="k", task="t")
    assert flow.claim_limited(first, OWNER, "k", "t", limits_).row is not None  # creates the limits row
    ids = held_jobs(pg, make_job, 200, Held.LIMIT)
    engine = sa.create_engine(pg)
    with engine.begin() as conn:
        conn.execute(sa.update(jobs).where(jobs.c.id == first).values(status="succeeded"))
    engine.dispose()
    woken = flow.wake_for_slot("k", None)
    assert len(woken) == 1
    assert sum(1 for status, held in statuses(pg, ids).values() if held is None) == 1


def test_a_rate_window_with_budget_n_wakes_n_held_jobs(pg, make_job, flow):
    """A claim that opens a window of rate 3 wakes 2 jobs held for the rate (it woke 7)."""
    rate = Limits(rate=Rate(3, 3600))
    first = make_job(pg, kind="k", task="t")
    ids = held_jobs(pg, make_job, 200, Held.RATE)
    result = flow.claim_limited(first, OWNER, "k", "t", rate)
    assert result.row is not None and result.row["window_claims"] == 1
    assert len(result.wake) == 2
    assert sum(1 for status, held in statuses(pg, ids).values() if held is None) == 2


# --- #18 item 1: every claim commits durably, in every mode --------------------------------


@pytest.fixture
def crashable_pg():
    """A private cluster whose WAL writer flushes every 10 s: an asynchronous commit is
    lost by a crash within that window."""
    from tests.harness import pgcluster

    if not pgcluster.available():
        pytest.skip("needs PostgreSQL server binaries (bash dev.sh test installs them)")
    with pgcluster.private_cluster(settings={"wal_writer_delay": "10s"}) as cluster:
        yield cluster


#: Every limited claim path: concurrency, rate, both (and the unlimited claim beside them).
VARIANTS = {
    "unlimited": None,
    "concurrency": Limits(concurrency=2),
    "rate": Limits(rate=Rate(5, 1)),
    "both": Limits(concurrency=2, rate=Rate(100, 60)),
}


def test_every_claim_survives_a_postgresql_crash_in_both_modes(crashable_pg, make_job):
    """A claim's generation is a fencing token: once a worker was told it, a crash of
    PostgreSQL must not roll it back (the job would be claimed again under the same
    generation, and two holders' fenced writes would both land). Unprepared, a limited
    kind's claim committed with synchronous_commit=off and was rolled back."""
    from celery_lease.db import migrate
    from celery_lease.db.store import Store
    from celery_lease.flow.store import FlowStore

    url = crashable_pg.create_database("jobs")
    migrate.upgrade(Store(url))
    # Every job first, the unprepared claims last: a durable commit flushes the WAL before it.
    claimed = {
        make_job(url, kind=f"{name}-{prepare}", task="t"): f"{name}-{prepare}" for prepare in (True, False) for name in VARIANTS
    }
    for prepare in (True, False):
        store = Store(url, prepare_statements=prepare)
        flow = FlowStore(store)
        for job, kind in [(j, k) for j, k in claimed.items() if k.endswith(str(prepare))]:
            limits_ = VARIANTS[kind.rpartition("-")[0]]
            if limits_ is None:
                row = claim_delivery(store, job, OWNER, "t")
            else:
                row = flow.claim_limited(job, OWNER, kind, "t", limits_).row
            assert row is not None and row["lease_generation"] == 1, kind
        store.dispose()
    crashable_pg.crash()
    crashable_pg.start()
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(sa.select(jobs.c.id, jobs.c.status, jobs.c.lease_generation).where(jobs.c.id.in_(claimed)))
            after = {claimed[str(r.id)]: (r.status, r.lease_generation) for r in rows}
    finally:
        engine.dispose()
    assert after == dict.fromkeys(claimed.values(), ("running", 1))


# --- #18 item 3: a claim whose reply was lost is adopted, whatever it claimed ----------------


def rows_of(pg, ids) -> dict[str, tuple[str, int]]:
    engine = sa.create_engine(pg)
    with engine.connect() as conn:
        rows = conn.execute(sa.select(jobs.c.id, jobs.c.status, jobs.c.lease_generation).where(jobs.c.id.in_(ids))).all()
    engine.dispose()
    return {str(r.id): (r.status, r.lease_generation) for r in rows}


@pytest.mark.parametrize(
    "limits_", [None, Limits(concurrency=2), Limits(rate=Rate(10, 60))], ids=["unlimited", "limited", "rated"]
)
@pytest.mark.parametrize("swap", [False, True], ids=["delivered", "priority-swap"])
def test_a_claim_whose_reply_was_lost_is_adopted(pg, make_job, pg_proxy, limits_, swap):
    """The claim reaches PostgreSQL and commits; its reply is lost and the connection
    drops. The retry must take the job the first try claimed: the delivered one, or the
    higher-priority job claimed in its place. (A limited kind's retry found the job
    running and claimed nothing; a swap's retry claimed the delivered job too: either
    way a job sat running with no body for a whole lease and spent an attempt.)"""
    from celery_lease.db.store import Store
    from celery_lease.flow.store import FlowStore

    delivered = make_job(pg, kind="k", task="t")
    better = make_job(pg, kind="k", task="t", priority=5) if swap else None
    claimed_id = better or delivered
    store = Store(pg_proxy.url_for(pg))
    flow = FlowStore(store)
    try:
        pg_proxy.cut_reply_to(delivered.encode())  # the first statement naming the job: its claim
        if limits_ is None:
            row = claim_delivery(store, delivered, OWNER, "t")
        else:
            row = flow.claim_limited(delivered, OWNER, "k", "t", limits_).row
        assert pg_proxy.cuts == 1  # the reply really was lost
    finally:
        store.dispose()
    assert row is not None and str(row["id"]) == claimed_id and row["lease_generation"] == 1
    expected = {claimed_id: ("running", 1)}
    if swap:
        expected[delivered] = ("pending", 0)  # not claimed: its wakeup is sent again
    assert rows_of(pg, expected) == expected


@pytest.mark.parametrize("landed", [True, False], ids=["claim-landed", "claimed-nothing"])
def test_a_lost_claim_reply_adopts_what_the_claim_took_never_another_row_of_its_owner(
    pg, broker, client_app, make_job, pg_proxy, landed
):
    """Issue #27 item 4: a job of the kind already runs under this worker's owner (its
    body finished; its success, waiting for the database, not yet written). The next
    claim's reply is lost. Adoption took ANY running row of the kind under the owner
    that the process did not hold: the finished job, run a second time with the same
    fencing token, while the delivered job waited for the sweeper. By the claim's token,
    the retry adopts the delivered job if its claim landed, and nothing if it claimed
    nothing (here: not due yet)."""
    from celery_lease.lifecycle.owner import owner_of

    mod = client_app(pg_proxy.url_for(pg), broker)
    host = "w@host"
    finished = make_job(
        pg,
        status="running",
        attempt=1,
        lease_generation=1,
        lease_owner=owner_of(host),
        lease_expires_at=sa.text("now() + interval '1 hour'"),
    )
    delivered = make_job(pg) if landed else make_job(pg, run_after=sa.text("now() + interval '1 hour'"))
    before = rows_of(pg, [finished])
    pg_proxy.cut_reply_to(delivered.encode())  # the first statement naming the job: its claim
    attempt = mod.leases.worker.begin(delivered, mod.echo.spec, host)
    assert pg_proxy.cuts == 1  # the reply really was lost
    if landed:
        assert attempt is not None and (attempt.job_id, attempt.generation) == (delivered, 1)
        assert rows_of(pg, [delivered]) == {delivered: ("running", 1)}
    else:
        assert attempt is None
        assert rows_of(pg, [delivered]) == {delivered: ("pending", 0)}
    assert rows_of(pg, [finished]) == before  # untouched: not adopted


# --- #18 item 5 and the clock stepping back: a rate window never freezes -----------------------


def test_a_kinds_rate_redeployed_in_another_unit_keeps_claiming(pg, make_job, flow):
    """ "5/s" redeployed as "300/m": the stored window number counted seconds and was
    compared with minutes; every claim was refused, for good."""
    first, second, third = (make_job(pg, kind="k", task="t") for _ in range(3))
    assert flow.claim_limited(first, OWNER, "k", "t", Limits(rate=Rate(5, 1))).row is not None
    result = flow.claim_limited(second, OWNER, "k", "t", Limits(rate=Rate(300, 60)))
    assert result.row is not None and result.held is None
    assert flow.claim_limited(third, OWNER, "k", "t", Limits(rate=Rate(5, 1))).row is not None  # and back


def test_a_database_clock_that_stepped_back_does_not_freeze_a_rated_kind(pg, make_job, flow):
    """The stored window is an hour ahead of the database clock (it stepped back after
    the window's claims): claims go on in the window the clock is in now."""
    first, second, third = (make_job(pg, kind="k", task="t") for _ in range(3))
    rate = Limits(rate=Rate(2, 1))
    assert flow.claim_limited(first, OWNER, "k", "t", rate).row is not None
    engine = sa.create_engine(pg)
    with engine.begin() as conn:
        conn.execute(sa.update(limits).values(rate_window=limits.c.rate_window + 3600, rate_claims=2, woken_window=0))
    engine.dispose()
    result = flow.claim_limited(second, OWNER, "k", "t", rate)
    assert result.row is not None and result.row["window_claims"] == 1  # a new window
    assert flow.claim_limited(third, OWNER, "k", "t", rate).row is not None


# --- #18 item 10: a window wakeup delivered early is sent again ----------------------------


def test_a_window_wakeup_delivered_early_is_sent_again_for_the_time_left(pg, broker, client_app, redis_server):
    """A rate window's wakeup is timed by a countdown on the publishing host's clock; a
    consumer whose clock is ahead (or a publisher whose clock is behind the database's)
    delivers it before its window opens. Its job, due only at the window's start by the
    database clock, is then not claimable yet, and the wakeup is published again for
    the time left. (The early claim was refused, re-held, and the window's one wakeup
    was spent: the backlog waited for the sweeper.)"""
    import json
    import time

    import redis

    mod = client_app(pg, broker, extra_env={"CL_TEST_RATE": "1/m"}, module="tests.apps.app_flow")
    spec = mod.rated.spec
    flow = mod.leases.flow
    while time.time() % 60 > 50:  # the three claims below fall in one minute
        time.sleep(1)
    first, second = (j.id for j in mod.rated.submit_many([{}] * 2))
    r = redis.Redis(port=redis_server.port)
    redis_server.flush()  # the submit's own wakeups: delivered (and spent)

    def wakeups_of(job_id: str) -> list[dict]:
        messages = [json.loads(m) for m in r.lrange("celery", 0, -1)]
        return [m["headers"] for m in messages if m["headers"]["id"] == job_id]

    assert flow.claim(first, spec, OWNER) is not None  # the minute's one claim
    assert flow.claim(second, spec, OWNER) is None  # held for the rate; it carries the next minute's wakeup
    (scheduled,) = wakeups_of(second)
    assert scheduled["eta"] is not None
    redis_server.flush()
    assert flow.claim(second, spec, OWNER) is None  # that wakeup, delivered early
    (again,) = wakeups_of(second)
    left = 60 - time.time() % 60
    eta = datetime.fromisoformat(again["eta"]).timestamp() - time.time()
    assert left - 5 < eta < left + 5
    assert statuses(pg, [second]) == {second: ("pending", "rate")}


# --- #18 item 4: nothing after a committed claim leaves its job without a body ---------------


def test_an_unreachable_broker_for_task_events_does_not_orphan_the_claimed_job(pg, client_app):
    """-E (task events) with the broker unreachable: the task-started event sent after
    the claim raised, the delivery ended before the body, and the job stayed running
    with no body until its lease expired. Runs Celery's own tracer (what a pool process
    runs per message) on a job whose claim commits."""
    from celery.app.trace import build_tracer

    from tests.conftest import free_port

    dead_broker = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    mod = client_app(pg, dead_broker, conf={"worker_send_task_events": True, "broker_connection_max_retries": 1})
    job = mod.leases.store.insert_jobs([mod.leases.producer.job_row(mod.echo.spec, {"value": 7}, {})], keyed=False)[0]
    tracer = build_tracer(mod.echo.name, mod.echo, app=mod.app, eager=False)
    tracer(job.id, (), {}, {"id": job.id, "delivery_info": {"routing_key": "celery"}, "hostname": "celery@events-test"})
    mod.leases.worker.flush()  # a success waits a few milliseconds for a batch
    done = mod.leases.get(job.id)
    assert (done.status.value, done.attempt) == ("succeeded", 1)


# --- #18 item 11: a client partitioned mid-transaction cannot stall the kind ------------------


@pytest.mark.timeout(90)  # without the server's timeout, the claim waits as long as the partition
def test_a_client_partitioned_while_holding_a_kinds_lock_stalls_its_claims_only_briefly(pg, make_job, pg_proxy):
    """A process takes the kind's limits row lock (a release, a top-up) and its network
    goes silent mid-transaction. The server ends that idle transaction
    (idle_in_transaction_session_timeout on every connection), so another worker's
    claim of the kind waits seconds, not until TCP keepalive gives up (minutes)."""
    import threading
    import time

    from celery_lease.db.engine import Timeouts
    from celery_lease.db.statements import flow as fs
    from celery_lease.db.store import Store
    from celery_lease.flow.store import FlowStore

    quick = Timeouts(idle_in_transaction=2.0)
    here = Store(pg, timeouts=quick)
    partitioned = Store(pg_proxy.url_for(pg), timeouts=quick)
    flow = FlowStore(here)
    limits_ = Limits(concurrency=1)
    first, second = (make_job(pg, kind="k", task="t") for _ in range(2))
    assert flow.claim_limited(first, OWNER, "k", "t", limits_).row is not None  # the kind's row exists
    locked, release = threading.Event(), threading.Event()

    def hold_the_lock(conn) -> None:
        if locked.is_set():
            return  # retried on a new connection once the server ended the first: done
        conn.execute(fs.lock_limits_row(), {"of_kind": "k"})
        pg_proxy.pause()  # from here on, nothing of this connection reaches the server
        locked.set()
        release.wait(25)

    holder = threading.Thread(target=lambda: _swallow(lambda: partitioned.transaction(partitioned.durable, hold_the_lock)))
    holder.start()
    try:
        assert locked.wait(10)
        started = time.monotonic()
        result = flow.claim_limited(second, OWNER, "k", "t", limits_)
        waited = time.monotonic() - started
        assert result.held == "limit"  # decided (the first job runs), not stuck behind the lock
        assert waited < 15, waited
    finally:
        release.set()
        pg_proxy.resume()
        holder.join(30)
        here.dispose()
        partitioned.dispose()


def _swallow(fn) -> None:
    try:
        fn()
    except Exception:
        pass  # the partitioned client's transaction was ended by the server


# --- #18 item 11: a top-up holds the kind's lock for one statement -----------------------------


def test_a_top_up_holds_the_kinds_lock_for_one_statement(pg, make_job):
    """The sweeper's top-up (and a spent delivery's) wakes what a kind has room for under
    its limits row lock: one statement after the lock (prepared: one round trip with
    it), not a count and two wakes, each a round trip with the kind's claims waiting.
    Counted at the driver (unprepared mode, where each statement is sent on its own)."""
    from celery_lease.db.store import Store
    from celery_lease.flow.store import FlowStore

    store = Store(pg, prepare_statements=False)
    flow = FlowStore(store)
    try:
        declared = Limits(concurrency=2, rate=Rate(3, 3600))
        first = make_job(pg, kind="k", task="t")
        assert flow.claim_limited(first, OWNER, "k", "t", declared).row is not None  # 1 of 2 slots, 1 of 3 claims
        by_limit = [make_job(pg, kind="k", task="t", held=Held.LIMIT.value, priority=p) for p in (1, 5, 3)]
        by_rate = [make_job(pg, kind="k", task="t", held=Held.RATE.value) for _ in range(3)]
        sent: list[str] = []

        def count(conn, cursor, statement, parameters, context, executemany) -> None:
            sent.append(statement)

        sa.event.listen(sa.engine.Engine, "before_cursor_execute", count)
        try:
            woken = {str(w["id"]) for w in flow.top_up("k", None)}
        finally:
            sa.event.remove(sa.engine.Engine, "before_cursor_execute", count)
        locked = next(i for i, s in enumerate(sent) if "FOR UPDATE" in s and "celery_lease_limits" in s)
        assert len(sent[locked + 1 :]) == 1, sent[locked + 1 :]
        # One free slot: the best-priority job held by the limit; the rate budget's second
        # claim left: one job held for the rate.
        assert by_limit[1] in woken and len(woken & set(by_limit)) == 1
        assert len(woken & set(by_rate)) == 1 and len(woken) == 2
        assert all(statuses(pg, woken)[w] == ("pending", None) for w in woken)
    finally:
        store.dispose()
