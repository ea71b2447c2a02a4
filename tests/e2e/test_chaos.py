"""The chaos suite: several hundred jobs through worker, child, Redis and PostgreSQL
faults; afterwards every job succeeded exactly once (none lost, none committed twice,
none stuck, none failed or expired: the chaos kinds have attempts to spare).

Production configurations (issue #9) run as variants: ``--pool threads``, two lease
lengths in the same workers, beat on a skewed clock, PostgreSQL crashing (a private
cluster, ``pg_ctl stop -m immediate``) in the middle. gevent and eventlet workers
(issue #20) see each fault but a child kill in turn; with RabbitMQ as the broker (a
private node) the broker node itself is SIGKILLed and booted again. The default run has
the classic scenario, one short variant that combines the production configurations,
and short gevent, eventlet and RabbitMQ runs; the full-size variants are ``slow``. Every
worker runs as teams deploy it: Celery's default bootsteps and ``-E``
(``Scenario.as_deployed``)::

    bash dev.sh test tests/e2e/test_chaos.py -m slow -s
    CHAOS_SECONDS=600 CHAOS_JOBS=2000 bash dev.sh test tests/e2e/test_chaos.py -m slow -k long -s

Each summary line is printed, shown in pytest's terminal summary and written to
$CHAOS_SUMMARY (default: the test's tmp dir).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import SUMMARY_LINES
from tests.harness import faketime, pgcluster
from tests.harness.chaos import FAULTS, LEASE_CONF, Scenario, run_lease_scenario, scenario_env


def _run(db, broker, redis_server, client_app, tmp_path, request, scenario: Scenario, *, name: str = "chaos", cluster=None):
    mod = client_app(db, broker, conf=LEASE_CONF, extra_env=scenario_env(scenario), module="tests.apps.app_leases")

    def submit(payloads):
        short = [p for p in payloads if p.get("lease") != "long"]
        long = [p for p in payloads if p.get("lease") == "long"]
        return [j.id for j in mod.chaos.submit_many(short)] + [j.id for j in mod.chaos_long.submit_many(long)]

    outcome = run_lease_scenario(db, redis_server, tmp_path, scenario, submit=submit, cluster=cluster)
    line = f"{name}: " + outcome.line()
    summary = Path(os.environ.get("CHAOS_SUMMARY") or tmp_path / "chaos-summary.txt")
    with summary.open("a") as fh:
        fh.write(line + "\n")
    # Shown in pytest's terminal summary (tests/conftest.py), so CI's log carries it.
    request.config.stash.setdefault(SUMMARY_LINES, []).append(line)
    print(line)

    assert outcome.jobs == scenario.jobs
    assert sum(outcome.faults.values()) > 0, line
    assert outcome.lost == 0, line
    assert outcome.duplicate_effects == 0, line
    assert outcome.extra["stray_effects"] == 0, line
    assert outcome.stuck_running == 0, line
    # A worker never ends on its own (a fault's restart would hide it: the fleet looks first).
    assert outcome.extra["worker_exits"] == 0, line
    # What the product promises: every job succeeded (none of these kinds may fail).
    assert outcome.statuses == {"succeeded": scenario.jobs}, line
    if scenario.pg_crash_at is not None:
        assert outcome.faults.get("crash_pg") == 1, line
        assert outcome.extra["succeeded_before_crash"] > 0, line
        assert outcome.extra["lost_successes"] == 0, line


@pytest.fixture
def crashable_db(tmp_path):
    """A migrated database on a private PostgreSQL cluster that the scenario may crash."""
    if not pgcluster.available():
        pytest.skip("needs PostgreSQL server binaries (bash dev.sh test installs them)")
    from celery_lease.db import migrate
    from celery_lease.db.store import Store
    from tests.apps.app import test_metadata

    with pgcluster.private_cluster(max_connections=200) as cluster:
        url = cluster.create_database("chaos")
        store = Store(url)
        migrate.upgrade(store)
        test_metadata.create_all(store.durable)
        store.dispose()
        yield cluster, url


needs_faketime = pytest.mark.skipif(not faketime.available(), reason="needs libfaketime (bash dev.sh test installs it)")


@pytest.mark.timeout(300)
def test_chaos_short(pg, broker, redis_server, client_app, tmp_path, request):
    """The classic faults in turn on a prefork worker for 25 s (the default run's time budget);
    the 50 s scenario runs with -m slow."""
    _run(
        pg, broker, redis_server, client_app, tmp_path, request, Scenario(seconds=25.0, fault_cycle=FAULTS), name="chaos (short)"
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_chaos(pg, broker, redis_server, client_app, tmp_path, request):
    _run(pg, broker, redis_server, client_app, tmp_path, request, Scenario())


@needs_faketime
@pytest.mark.timeout(300)
def test_chaos_production_mix_short(crashable_db, broker, redis_server, client_app, tmp_path, request):
    """All the production configurations at once, short: threads pool, 3 s and 30 s
    leases in the same workers, beat 6 s slow, PostgreSQL crashing in the middle."""
    cluster, url = crashable_db
    scenario = Scenario(
        jobs=120,
        seconds=20.0,
        drain_seconds=90.0,
        pool="threads",
        concurrency=4,
        mixed_leases=True,
        beat_skew="-6s",
        pg_crash_at=9.0,
    )
    name = "chaos (threads, mixed leases, beat -6s, pg crash)"
    _run(url, broker, redis_server, client_app, tmp_path, request, scenario, name=name, cluster=cluster)


#: A green worker has no pool children: each of the other faults in turn.
GREEN_FAULTS = ("kill_worker", "terminate_pg", "restart_broker")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pool", ["gevent", "eventlet"])
def test_chaos_green_pool_short(pg, broker, redis_server, client_app, tmp_path, request, pool):
    """The classic faults on a gevent / eventlet worker (no pool children to kill: the
    whole worker is the SIGKILL target), short."""
    scenario = Scenario(jobs=80, seconds=9.0, pool=pool, concurrency=8, fault_cycle=GREEN_FAULTS)
    _run(pg, broker, redis_server, client_app, tmp_path, request, scenario, name=f"chaos ({pool}, short)")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("pool", ["gevent", "eventlet"])
def test_chaos_green_pool(pg, broker, redis_server, client_app, tmp_path, request, pool):
    scenario = Scenario(pool=pool, concurrency=8, fault_cycle=GREEN_FAULTS)
    _run(pg, broker, redis_server, client_app, tmp_path, request, scenario, name=f"chaos ({pool})")


#: Every broker restart is a SIGKILL of the node and a boot (5-15 s here).
RABBITMQ_FAULTS = ("kill_worker", "terminate_pg", "kill_child", "restart_broker")


@pytest.mark.timeout(400)
def test_chaos_rabbitmq_short(pg, amqp_broker, client_app, tmp_path, request):
    """RabbitMQ as the broker: workers and pool children SIGKILLed, PostgreSQL backends
    terminated, and the broker node itself SIGKILLed and restarted mid-run."""
    scenario = Scenario(jobs=80, seconds=12.0, fault_cycle=RABBITMQ_FAULTS)
    _run(pg, amqp_broker.url, amqp_broker, client_app, tmp_path, request, scenario, name="chaos (rabbitmq, short)")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_chaos_rabbitmq(pg, amqp_broker, client_app, tmp_path, request):
    scenario = Scenario(fault_cycle=RABBITMQ_FAULTS)
    _run(pg, amqp_broker.url, amqp_broker, client_app, tmp_path, request, scenario, name="chaos (rabbitmq)")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_chaos_threads_pool(pg, broker, redis_server, client_app, tmp_path, request):
    _run(pg, broker, redis_server, client_app, tmp_path, request, Scenario(pool="threads", concurrency=4), name="chaos (threads)")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_chaos_mixed_leases(pg, broker, redis_server, client_app, tmp_path, request):
    scenario = Scenario(mixed_leases=True)
    _run(pg, broker, redis_server, client_app, tmp_path, request, scenario, name="chaos (mixed leases 3 s / 30 s)")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_chaos_postgresql_crash(crashable_db, broker, redis_server, client_app, tmp_path, request):
    cluster, url = crashable_db
    scenario = Scenario(pg_crash_at=25.0)
    _run(url, broker, redis_server, client_app, tmp_path, request, scenario, name="chaos (pg crash)", cluster=cluster)


@needs_faketime
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("skew", ["-6s", "+5m"])
def test_chaos_beat_skewed(pg, broker, redis_server, client_app, tmp_path, request, skew):
    _run(pg, broker, redis_server, client_app, tmp_path, request, Scenario(beat_skew=skew), name=f"chaos (beat {skew})")


@pytest.mark.slow
@pytest.mark.timeout(0)
@pytest.mark.skipif(not os.environ.get("CHAOS_SECONDS"), reason="long chaos: set CHAOS_SECONDS (e.g. 600)")
def test_chaos_long(pg, broker, redis_server, client_app, tmp_path, request):
    _run(pg, broker, redis_server, client_app, tmp_path, request, Scenario.from_env(jobs=2000))
