"""A PostgreSQL crash right after a claim (a private cluster with ``wal_writer_delay``
raised, so a commit made asynchronously is lost by it): the fencing token handed to a
body is never handed to another body, crashes included (docs/fencing.md)."""

from __future__ import annotations

import threading
import time

import pytest
import sqlalchemy as sa

from celery_lease.db.schema import jobs
from tests.apps.history_tables import bodies
from tests.conftest import wait_for
from tests.harness import pgcluster
from tests.harness.history_run import MODULE, databases, worker_env


@pytest.fixture
def crash_dbs():
    if not pgcluster.available():
        pytest.skip("needs PostgreSQL server binaries (bash dev.sh test installs them)")
    with databases() as dbs:
        yield dbs


def _async_writes(cluster, stop: threading.Event) -> None:
    try:
        conn = cluster.connect("jobs")
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute("CREATE TABLE IF NOT EXISTS crash_noise (n int)")
            cur.execute("SET synchronous_commit = off")
            while not stop.is_set():
                cur.execute("INSERT INTO crash_noise VALUES (1)")
                time.sleep(0.02)
    except Exception:
        return  # the crash ends it


def _bodies(history_url: str, job_id: str) -> list[dict]:
    engine = sa.create_engine(history_url, poolclass=sa.pool.NullPool)
    with engine.connect() as conn:
        rows = [dict(r) for r in conn.execute(sa.select(bodies).where(bodies.c.job_id == job_id)).mappings()]
    engine.dispose()
    return rows


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "prepared",
    # The unprepared claim was the one committed asynchronously (issue #18 item 1).
    [pytest.param(True, id="prepared", marks=pytest.mark.slow), pytest.param(False, id="unprepared")],
)
def test_a_limited_claim_survives_a_crash_so_no_generation_has_two_holders(
    crash_dbs, broker, client_app, workers, tmp_path, prepared
):
    """Issue #18 item 1: a limited kind's claim committed with synchronous_commit=off
    was lost by an immediate shutdown; the row came back at generation 0 and a second
    worker ran a body under generation 1 again, both holders' fenced writes accepted."""
    cluster, jobs_url, history_url = crash_dbs
    conf = {"lease_prepare_statements": prepared, "lease_sweep_stale_seconds": 1}
    env = {**worker_env(history_url), "CL_TEST_LEASE": "30"}  # no renewal flushes the WAL meanwhile
    mod = client_app(jobs_url, broker, conf=conf, extra_env=env, module=MODULE)
    workers(jobs_url, broker, name="w1", conf=conf, extra_env=env, module=MODULE, concurrency=1)
    # Asynchronous commits elsewhere keep the WAL writer busy (not hibernating, which
    # an asynchronous commit would wake at once): it flushes every 10 s only.
    stop = threading.Event()
    noise = threading.Thread(target=_async_writes, args=(cluster, stop), daemon=True)
    noise.start()
    time.sleep(1)
    gate = tmp_path / "gate"
    job = mod.h_limited.submit({"steps": 1, "sleep": 0.01, "gate": str(gate)})
    wait_for(lambda: _bodies(history_url, job.id), timeout=30, interval=0.01, what="the first body to start")
    cluster.crash()  # milliseconds after the claim committed
    stop.set()
    noise.join(timeout=10)
    cluster.start()
    workers(jobs_url, broker, name="w2", conf=conf, extra_env=env, module=MODULE, concurrency=1)
    # Whatever the crash kept, a wakeup now: a second claim happens if the row allows it.
    time.sleep(1.5)
    wait_for(lambda: mod.leases.sweep() >= 0, timeout=30, what="a sweep after the restart")
    time.sleep(3)
    gate.touch()
    engine = sa.create_engine(jobs_url, poolclass=sa.pool.NullPool)
    with engine.connect() as conn:
        row = conn.execute(sa.select(jobs.c.status, jobs.c.lease_generation).where(jobs.c.id == job.id)).one()
    engine.dispose()
    ran = _bodies(history_url, job.id)
    generations = [b["generation"] for b in ran]
    assert len(set(generations)) == len(generations), f"two bodies under one generation: {ran}; row now {row}"
