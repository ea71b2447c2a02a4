"""gevent and eventlet pools (``celery worker -P gevent|eventlet``): leases, cancel and
the product's own database calls in one process of greenlets.

The fault suite runs on these pools too: tests/e2e/test_chaos.py (a scenario per pool),
tests/e2e/test_faults.py (warm shutdown, parametrized by pool) and the cancel notice below.
eventlet's longer variants run with ``-m slow``.
"""

from __future__ import annotations

import time

import pytest
import sqlalchemy as sa

from celery_lease.db.schema import jobs
from tests.apps.app import effects
from tests.conftest import wait_for
from tests.e2e.test_faults import LONG, SHORT, _cancel_waiter

POOLS = ["gevent", "eventlet"]
#: The longer tests run eventlet (deprecated upstream, the rarer pool) only with -m slow.
POOLS_EVENTLET_SLOW = ["gevent", pytest.param("eventlet", marks=pytest.mark.slow)]
#: The connections to this test's database that celery-lease holds (the workers', and
#: this process's for its reaps: at most a couple).
WORKER_CONNECTIONS = sa.text(
    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND application_name = 'celery-lease'"
)


@pytest.fixture
def db(pg):
    engine = sa.create_engine(pg)
    yield engine
    engine.dispose()


def _run_all(
    leases, db, ids: list[str], timeout: float, connections: list[int] | None = None, sweep: bool = False
) -> tuple[list[dict], dict]:
    """Reap as eagerly as can be until every job is terminal; the rows and reap counts.
    ``connections`` collects, at each poll, how many connections the workers hold;
    ``sweep``: re-send stale wakeups too, as beat does (a restarted broker lost some)."""
    reaped = {"requeued": 0, "expired": 0}

    def finished() -> bool:
        if sweep:
            leases.sweep()
        if connections is not None:
            with db.connect() as conn:
                connections.append(conn.execute(WORKER_CONNECTIONS).scalar())
        for key, value in leases.reap().items():
            reaped[key] = reaped.get(key, 0) + value
        with db.connect() as conn:
            left = conn.execute(
                sa.select(sa.func.count()).where(jobs.c.id.in_(ids), jobs.c.status.in_(["pending", "running"]))
            ).scalar()
        return left == 0

    wait_for(finished, timeout=timeout, interval=0.3, what="every job to finish")
    with db.connect() as conn:
        rows = [dict(r) for r in conn.execute(sa.select(jobs).where(jobs.c.id.in_(ids))).mappings()]
    return rows, reaped


def _effects(db) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    with db.connect() as conn:
        for job_id, attempt in conn.execute(sa.select(effects.c.job_id, effects.c.attempt)):
            out.setdefault(job_id, []).append(attempt)
    return out


@pytest.mark.parametrize("pool", POOLS)
def test_effects_waiting_in_postgresql_overlap_and_keep_their_leases(pg, broker, client_app, workers, db, pool):
    # Twelve success transactions each wait 2.5 s in PostgreSQL with 3 s leases. A
    # driver that blocks the process runs them one after another (30 s, the heartbeat
    # stalled meanwhile); a green one overlaps them.
    mod = client_app(pg, broker, extra_env=SHORT, module="tests.apps.app_faults")
    workers(pg, broker, pool=pool, concurrency=12, extra_env=SHORT, module="tests.apps.app_faults")
    ids = [j.id for j in mod.pg_wait.submit_many([{"seconds": 2.5}] * 12)]
    rows, reaped = _run_all(mod.leases, db, ids, timeout=90)
    assert reaped == {"requeued": 0, "expired": 0}
    assert [(r["status"], r["attempt"], r["lease_losses"]) for r in rows] == [("succeeded", 1, 0)] * 12
    assert _effects(db) == {job_id: [1] for job_id in ids}
    with db.connect() as conn:
        waited = [float(n) for n in conn.execute(sa.select(effects.c.note)).scalars()]
    started = [r["started_at"].timestamp() for r in rows]
    # All twelve were running at once, and the whole batch took little more than one wait.
    assert max(started) < min(waited)
    span = max(waited) - min(started)
    assert span < 10, f"the twelve 2.5 s waits took {span:.1f} s: they did not overlap"


@pytest.mark.parametrize("pool", POOLS_EVENTLET_SLOW)
def test_a_hundred_greenlets_blocked_on_io_keep_their_leases(pg, broker, client_app, workers, db, pool):
    # 100 handlers sleep (on the hub) 6 s, two leases' worth: one heartbeat greenlet
    # renews all their leases meanwhile, none is reaped by the eager reaper, and the
    # worker does not open a database connection per greenlet.
    mod = client_app(pg, broker, extra_env=SHORT)
    # Pools of earlier tests' apps in this pytest process may still hold connections to
    # the run's database (fresh-clone run 7 counted 35-59): counted from before the worker.
    with db.connect() as conn:
        before = conn.execute(WORKER_CONNECTIONS).scalar()
    workers(pg, broker, pool=pool, concurrency=100, extra_env=SHORT)
    ids = [j.id for j in mod.sleepy.submit_many([{"sleep": 6}] * 100)]
    connections: list[int] = []
    rows, reaped = _run_all(mod.leases, db, ids, timeout=120, connections=connections)
    # Greenlets queue for pooled connections (GREEN_POOL_SIZE per engine): far fewer
    # than one per greenlet (43 and 64 at peak when sized like threads).
    assert max(connections) - before <= 30, (before, connections)
    assert reaped == {"requeued": 0, "expired": 0}
    assert sorted((r["status"], r["attempt"], r["lease_losses"]) for r in rows) == [("succeeded", 1, 0)] * 100
    assert _effects(db) == {job_id: [1] for job_id in ids}
    assert max(r["started_at"] for r in rows) < min(r["finished_at"] for r in rows)  # all 100 at once


@pytest.mark.parametrize("pool", POOLS)
def test_cancel_notice_stops_a_green_handler(pg, broker, client_app, workers, marker_dir, pool):
    # A 300 s lease: only the notice (woken heartbeat greenlet) stops it this soon.
    _cancel_waiter(pg, broker, client_app, workers, marker_dir, LONG, lambda mod, job_id: mod.leases.cancel(job_id), pool=pool)


@pytest.fixture(params=["redis", "rabbitmq"])
def restartable_broker(request):
    """A private broker the test may kill and restart: a Redis server, or a RabbitMQ node."""
    if request.param == "rabbitmq":
        return request.getfixturevalue("amqp_broker")
    request.getfixturevalue("broker")  # flushed
    return request.getfixturevalue("redis_server")


@pytest.mark.timeout(240)
def test_a_broker_restart_costs_no_lease_on_a_gevent_worker(pg, restartable_broker, client_app, workers, db):
    """Issue #27 item 6: the lease lives in PostgreSQL, so no broker outage may cost one.
    Sixteen jobs run on 3 s leases while the worker's broker (Redis, or a RabbitMQ node) is
    killed and restarted: each keeps its lease (its heartbeat is not held up by kombu's
    reconnect loop), succeeds on its first attempt, and the worker consumes again
    afterwards."""
    broker_restart_keeps_leases(pg, restartable_broker, client_app, workers, db, pool="gevent", count=16)


@pytest.mark.timeout(240)
def test_a_worker_run_as_deployed_outlives_redis_restarts(pg, broker, redis_server, client_app, workers, db):
    """A gevent worker with Celery's default bootsteps and task events (-E, for Flower)
    while its Redis is killed and restarted eight times, each time with four jobs running
    and four more delivered (prefetched, not yet acknowledged): Celery 5.7's consumer
    closed the collected connection twice, and restoring those four from a transport
    already detached ended the worker with "Unrecoverable error: AttributeError(...
    'hostname')" (worker/broker_restart.py). The worker stays up, every job keeps its
    lease, and it consumes again after the last restart."""
    mod = client_app(pg, redis_server.url, {"lease_sweep_stale_seconds": 2}, extra_env=SHORT, module="tests.apps.app_faults")
    worker = workers(
        pg,
        redis_server.url,
        pool="gevent",
        concurrency=4,
        conf={"worker_prefetch_multiplier": 4},
        extra_env=SHORT,
        module="tests.apps.app_faults",
        as_deployed=True,
    )
    ids: list[str] = []

    def running() -> int:
        return sum(mod.leases.get(i).status.value == "running" for i in ids)

    def ended() -> bool:  # an unrecoverable error is followed by a warm stop
        return worker.proc.poll() is not None or "Unrecoverable error" in worker.log()

    for _ in range(8):
        ids += [j.id for j in mod.waiter.submit_many([{"polls": 20}] * 8)]
        wait_for(lambda: running() == 4 or ended(), timeout=60, what="four jobs to run")
        assert not ended(), f"the worker ended at a Redis restart:\n{worker.log()[-3000:]}"
        redis_server.restart(downtime=1)
        time.sleep(1)  # the consumer's reconnect
    # A restart loses the wakeups Redis held (and the prefetched ones it could not
    # acknowledge): the sweeper re-sends them, as beat would.
    rows, reaped = _run_all(mod.leases, db, ids, timeout=120, sweep=True)
    assert reaped == {"requeued": 0, "expired": 0}
    assert [(r["status"], r["attempt"], r["lease_losses"]) for r in rows] == [("succeeded", 1, 0)] * len(ids)
    later = mod.waiter.submit({"polls": 1})
    rows, _ = _run_all(mod.leases, db, [later.id], timeout=90)
    assert rows[0]["status"] == "succeeded"
    assert not ended()


def broker_restart_keeps_leases(pg, server, client_app, workers, db, *, pool: str, count: int) -> None:
    """``count`` jobs on 3 s leases run on one worker while its broker ``server`` is killed
    and restarted: each keeps its lease and succeeds on its first attempt, and the worker
    consumes again afterwards."""
    mod = client_app(pg, server.url, extra_env=SHORT, module="tests.apps.app_faults")
    workers(pg, server.url, pool=pool, concurrency=count, extra_env=SHORT, module="tests.apps.app_faults")
    ids = [j.id for j in mod.waiter.submit_many([{"polls": 80}] * count)]
    wait_for(lambda: all(mod.leases.get(i).status.value == "running" for i in ids), timeout=30, what="every job to run")
    server.restart(downtime=3)
    rows, reaped = _run_all(mod.leases, db, ids, timeout=60)
    assert reaped == {"requeued": 0, "expired": 0}
    assert [(r["status"], r["attempt"], r["lease_losses"]) for r in rows] == [("succeeded", 1, 0)] * count
    later = mod.waiter.submit({"polls": 1})
    rows, _ = _run_all(mod.leases, db, [later.id], timeout=90)
    assert rows[0]["status"] == "succeeded"
