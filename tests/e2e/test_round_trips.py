"""What a job costs in round trips to PostgreSQL, counted on the wire (a CountingProxy
between the worker and the server, tests/harness/wirecount.py), so no change to the
claim, completion or heartbeat path can add one unnoticed (issue #27: "no round trip is
added").

- Claim and success: one prepared claim per delivery (of one job or many), the successes
  written by the completer in one statement for many: at most about one round trip per job.
- Heartbeat: one renewal statement per process and tick for every job it holds, so
  sixteen jobs cost what one does.

Time-driven round trips (the limit-override refresh, the worker's own checks) are
measured while the worker idles and taken off, as a rate.
"""

from __future__ import annotations

import time

import pytest
import sqlalchemy as sa

from celery_lease.db.schema import jobs
from tests.conftest import wait_for
from tests.e2e.test_faults import SHORT
from tests.harness.wirecount import CountingProxy

#: Round trips per job for the claim and completion path: a claim per delivery and the
#: completer's statement for the successes that wait together. A statement added per job
#: would make them 2.1 and 3.1 (the bounds date from one claim per job).
CLAIM_AND_SUCCESS = {"threads": 1.5, "prefork": 2.5}


@pytest.fixture
def proxy():
    proxy = CountingProxy().start()
    yield proxy
    proxy.close()


@pytest.fixture
def db(pg):
    engine = sa.create_engine(pg)
    yield engine
    engine.dispose()


def _idle_rate(proxy: CountingProxy, seconds: float = 4.0) -> float:
    """Round trips per second of a worker with nothing to do."""
    time.sleep(1.0)  # start-up statements done
    start, t0 = proxy.round_trips, time.monotonic()
    time.sleep(seconds)
    return (proxy.round_trips - start) / (time.monotonic() - t0)


def _left(db, ids: list[str]) -> int:
    with db.connect() as conn:
        finished = conn.execute(sa.select(sa.func.count()).where(jobs.c.id.in_(ids), jobs.c.status == "succeeded")).scalar_one()
    return len(ids) - finished


def _spent(proxy: CountingProxy, idle: float, run) -> float:
    """Round trips spent while ``run()`` runs, less the idle rate over that time."""
    start, t0 = proxy.round_trips, time.monotonic()
    run()
    return proxy.round_trips - start - idle * (time.monotonic() - t0)


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_a_job_costs_about_one_round_trip(pg, broker, client_app, workers, db, proxy, pool):
    n = 300
    mod = client_app(pg, broker)  # submits directly, not through the proxy
    workers(proxy.url_for(pg), broker, pool=pool, concurrency=2)
    idle = _idle_rate(proxy)

    def drain() -> None:
        ids = [j.id for j in mod.echo.submit_many([{"value": i} for i in range(n)])]
        wait_for(lambda: _left(db, ids) == 0, timeout=180, interval=0.2, what="every job to succeed")

    per_job = _spent(proxy, idle, drain) / n
    print(f"round trips per job ({pool}): {per_job:.2f} (idle {idle:.1f}/s)")
    assert per_job <= CLAIM_AND_SUCCESS[pool]


def test_heartbeats_cost_the_same_for_one_job_or_sixteen(pg, broker, client_app, workers, db, proxy):
    mod = client_app(pg, broker, extra_env=SHORT, module="tests.apps.app_faults")
    workers(proxy.url_for(pg), broker, pool="threads", concurrency=16, extra_env=SHORT, module="tests.apps.app_faults")
    idle = _idle_rate(proxy)
    rates = {}
    for count in (1, 16):
        # 10 s on 3 s leases: no job ends within the 4 s counted below (a many-job claim
        # runs its jobs one after another, so a job "running" may not have started; an
        # ending is a Landing transaction of several round trips, not a heartbeat's cost).
        ids = [j.id for j in mod.waiter.submit_many([{"polls": 100}] * count)]
        wait_for(lambda ids=ids: all(mod.leases.get(i).status.value == "running" for i in ids), timeout=30, what="jobs to run")
        # The claims are behind us, and the heartbeat's connection is open (its first
        # renewal, a second in): from here, renewals every second.
        time.sleep(1.5)

        def hold() -> None:
            time.sleep(4.0)

        rates[count] = _spent(proxy, idle, hold) / 4.0
        wait_for(lambda ids=ids: _left(db, ids) == 0, timeout=60, interval=0.2, what="the jobs to succeed")
    print(f"round trips per second while holding 1 job: {rates[1]:.2f}, 16 jobs: {rates[16]:.2f} (idle {idle:.1f}/s)")
    # One renewal statement a second holds all of them (a few claims or successes of
    # stragglers may fall in the window): nothing near one per job.
    assert rates[16] <= rates[1] + 2.0
