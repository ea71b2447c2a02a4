"""Coalesced wakeups (celery_lease/broker/waking.py) with real `celery worker` processes,
PostgreSQL and a private Redis: a submit of a kind with no limit in its code publishes a
wakeup only when it sets the (task, routing key) mark, and a delivery deletes that mark
before it claims what is due (worker/many_claim.py).

The kind is tests.apps.app_flow's ``unlimited`` (no ``batch=``, no limits): its body
records its own start and end in ``test_flow_spans`` with the database clock, so the
tests measure what the bodies did, not what the claims say.

No beat runs, so no maintenance tick reaches the workers: a job left pending without a
wakeup stays pending (the first test proves it with a canary each run). A stranded job
is therefore a failure here, not a 30 s delay hidden by the sweeper.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import redis
import sqlalchemy as sa

from celery_lease.db.schema import jobs
from tests.apps.app_flow import flow_metadata, spans
from tests.conftest import wait_for

MODULE = "tests.apps.app_flow"
#: Belt and braces: even a stray sweep tick would not re-send a wakeup within a test.
CONF = {"lease_sweep_stale_seconds": 3600}


@pytest.fixture
def db(pg):
    engine = sa.create_engine(pg)
    flow_metadata.create_all(engine)  # (the pg fixture truncates the library's tables, not this one)
    with engine.begin() as conn:
        conn.execute(spans.delete())
    yield engine
    engine.dispose()


def states(db, ids) -> dict[str, tuple[str, int]]:
    """id -> (status, attempt), in one query (400 leases.get calls would be slow)."""
    with db.connect() as conn:
        stmt = sa.select(jobs.c.id, jobs.c.status, jobs.c.attempt).where(jobs.c.id.in_(list(ids)))
        return {str(r.id): (r.status, r.attempt) for r in conn.execute(stmt)}


def wait_succeeded(db, ids, timeout: float, interval: float = 0.01) -> None:
    def not_done() -> dict[str, tuple[str, int]]:
        return {i: s for i, s in states(db, ids).items() if s[0] != "succeeded"}

    try:
        wait_for(lambda: not not_done() or None, timeout=timeout, interval=interval, what=f"{len(ids)} jobs to succeed")
    except AssertionError:
        raise AssertionError(f"not succeeded after {timeout:.1f}s (stranded?): {not_done()}") from None


def span_rows(db, ids) -> list[dict]:
    with db.connect() as conn:
        stmt = sa.select(spans).where(spans.c.job_id.in_(list(ids))).order_by(spans.c.started_at)
        return [dict(r) for r in conn.execute(stmt).mappings()]


def max_overlap(rows: list[dict]) -> int:
    """The most bodies running at one instant (an end and a start at the same instant do
    not overlap)."""
    points = [(r["started_at"], 1) for r in rows] + [(r["ended_at"], -1) for r in rows]
    running = most = 0
    for _, step in sorted(points, key=lambda p: (p[0], p[1])):
        running += step
        most = max(most, running)
    return most


def queued(broker: str, queue: str = "celery") -> int:
    """Messages waiting in the queue's Redis lists (kombu keeps one per priority step)."""
    r = redis.Redis.from_url(broker)
    try:
        keys = [queue.encode()] + [k for k in r.keys(queue + "\x06\x16*")]
        return sum(r.llen(k) for k in keys)
    finally:
        r.close()


def assert_clean(worker) -> None:
    """No traceback in the worker's log, and no wakeup it had to leave to the sweeper."""
    log = worker.log()
    bad = [line for line in log.splitlines() if "Traceback" in line or "sweeper will" in line]
    assert not bad, bad


@pytest.mark.timeout(150)
@pytest.mark.parametrize("pool", ["prefork", "threads", "gevent"])
def test_no_job_waits_for_the_sweeper_while_submits_race_the_claims(pg, db, broker, client_app, workers, pool):
    """On every pool teams run: with threads and greenlets, the deliveries of one process
    share its learned claim size, its marks' kept Redis connection and its completer."""
    mod = client_app(pg, broker, conf=CONF, module=MODULE)

    # The canary: a job of another default kind whose only wakeup is deleted before any
    # worker runs. Only a sweep could run it; it must still be pending at the end, or a
    # stranded "unlimited" job below could have been rescued by the sweeper unseen.
    # (Claims are per kind: no "unlimited" claim takes it.)
    canary = mod.leases.submit("echo", {"value": "canary"}).id
    assert queued(broker) == 1
    redis.Redis.from_url(broker).delete("celery")

    w = workers(pg, broker, module=MODULE, concurrency=2, conf=CONF, pool=pool)

    # Four threads submit one job at a time, racing the worker's claims and the marks
    # they delete, in rounds, each drained before the next: a job stranded mid-stream
    # would be rescued by a later submit's wakeup (a claim takes every due job of the
    # kind), so only the end of a stream can show one. Hence many short rounds (one job
    # per thread: 80 ends) and two long ones (ten per thread: claims come back full and
    # wake the kind for the rest). Pausing 0-3 ms *before* each submit spreads a round's
    # submits across the delivery's claim: a worker changed to delete the mark after its
    # claim stranded ~9% of short rounds (failed 3 runs of 3), and so does one that drops
    # a delivery as a duplicate after deleting its mark, without claiming.
    ids: list[str] = []
    errors: list[BaseException] = []

    def submit(n: int, out: list[str]) -> None:
        rnd = random.Random()
        try:
            for _ in range(n):
                time.sleep(rnd.uniform(0, 0.003))
                out.append(mod.unlimited.submit({}).id)
        except BaseException as exc:  # shown by the assertion below, not lost in a thread
            errors.append(exc)

    deadline = time.monotonic() + 30
    for per_thread in [10] + [1] * 40 + [10] + [1] * 40:
        batch: list[str] = []
        threads = [threading.Thread(target=submit, args=(per_thread, batch)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        ids += batch
        wait_succeeded(db, batch, timeout=max(0.1, deadline - time.monotonic()))

    assert len(set(ids)) == 400
    # Each ran once, on its first attempt: no claim lost and none taken twice.
    assert {s for s in states(db, ids).values()} == {("succeeded", 1)}
    assert len(span_rows(db, ids)) == 400
    # The canary is still pending, never attempted: no sweep ran in this window.
    assert states(db, [canary]) == {canary: ("pending", 0)}
    assert_clean(w)


@pytest.mark.timeout(120)
def test_twenty_200ms_jobs_on_four_pool_processes_run_four_at_a_time(pg, db, broker, client_app, workers):
    """A delivery claims as many jobs as run in about 50 ms here (worker/many_claim.py): for
    200 ms bodies that is one, so the single coalesced wakeup of a submit_many must
    spread the jobs over every pool process (each claim wakes the kind for the rest),
    not run them one after another in one process. (Before coalescing each job had its
    own wakeup: this passes there too. Fresh pool processes join one claim at a time,
    ~0.1 s each, hence 1.4-1.6 s measured rather than 1.1 s.)"""
    mod = client_app(pg, broker, conf=CONF, module=MODULE)
    w = workers(pg, broker, module=MODULE, concurrency=4, conf=CONF)
    ids = [j.id for j in mod.unlimited.submit_many([{"sleep": 0.2}] * 20)]
    wait_succeeded(db, ids, timeout=30)
    rows = span_rows(db, ids)
    assert len(rows) == 20 and {r["attempt"] for r in rows} == {1}
    wall = (max(r["ended_at"] for r in rows) - min(r["started_at"] for r in rows)).total_seconds()
    most = max_overlap(rows)
    detail = f"wall {wall:.2f}s, at most {most} at once, pids {sorted({r['pid'] for r in rows})}"
    print(detail)  # (shown with -s, or under a failure)
    # About five rounds of four (~1.1 s); one after another would take 4 s.
    assert wall < 2.0, detail
    assert 3 <= most <= 4, detail
    assert_clean(w)


@pytest.mark.timeout(120)
def test_submits_share_wakeups(pg, db, broker, client_app, workers):
    """With no worker to take them, 50 submits one by one leave one wakeup (two if the
    mark's 2 s expiry passed meanwhile), not 50 as before coalescing; the worker then
    runs all 50 from it."""
    mod = client_app(pg, broker, conf=CONF, module=MODULE)
    ids = [mod.unlimited.submit({}).id for _ in range(50)]
    waiting = queued(broker)
    print(f"{waiting} message(s) queued for 50 submits")
    assert 1 <= waiting < 5, f"{waiting} messages queued for 50 submits"
    w = workers(pg, broker, module=MODULE, concurrency=2, conf=CONF)
    wait_succeeded(db, ids, timeout=30)
    assert {s for s in states(db, ids).values()} == {("succeeded", 1)}
    assert len(span_rows(db, ids)) == 50
    assert_clean(w)
