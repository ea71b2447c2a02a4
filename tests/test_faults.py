"""Leases under faults, against real PostgreSQL, Redis and `celery worker` processes.

Each test breaks one thing the way production breaks it (SIGKILL, SIGSTOP, a warm
shutdown, a flushed or stopped Redis, terminated PostgreSQL backends) and checks the
guarantee that must survive it. Leases are made short with CL_TEST_LEASE so expiry is
reached in seconds; waits are generous because the machine is small and shared.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from datetime import datetime, timedelta, timezone

import pytest
import sqlalchemy as sa

from celery_lease import Status
from celery_lease.schema import events, jobs
from tests.app import effects
from tests.conftest import wait_for

SHORT = {"CL_TEST_LEASE": "3"}  # heartbeats every second
MEDIUM = {"CL_TEST_LEASE": "6"}  # heartbeats every two seconds
LONG = {"CL_TEST_LEASE": "300"}  # never expires within a test


@pytest.fixture
def db(pg):
    engine = sa.create_engine(pg)
    yield engine
    engine.dispose()


def row(db, job_id: str) -> dict:
    with db.connect() as conn:
        return dict(conn.execute(sa.select(jobs).where(jobs.c.id == job_id)).mappings().one())


def lease_in_future(db, job_id: str) -> bool:
    with db.connect() as conn:
        return conn.execute(
            sa.select(jobs.c.lease_expires_at > sa.func.now()).where(jobs.c.id == job_id)
        ).scalar()


def effect_rows(db, job_id: str | None = None) -> list[tuple[str, int]]:
    stmt = sa.select(effects.c.job_id, effects.c.attempt).order_by(effects.c.id)
    if job_id is not None:
        stmt = stmt.where(effects.c.job_id == job_id)
    with db.connect() as conn:
        return [tuple(r) for r in conn.execute(stmt)]


def run_events(db, job_id: str) -> list[tuple[str, str | None]]:
    with db.connect() as conn:
        return [tuple(r) for r in conn.execute(
            sa.select(events.c.event, events.c.detail).where(events.c.job_id == job_id).order_by(events.c.id))]


def checkpoint_reached(db, job_id: str, i: int) -> bool:
    r = row(db, job_id)
    return r["status"] == "running" and (r["checkpoint"] or {}).get("i", 0) >= i


def pid_in(marker) -> int:
    """The pid a handler wrote into its marker file (the pool child running it)."""
    wait_for(marker.exists, timeout=30, what=f"marker {marker.name}")
    return int(marker.read_text().split()[0])


def reap_until(leases, key: str, n: int = 1, timeout: float = 40) -> dict:
    """Run the reaper until it reports ``n`` jobs moved to ``key``."""
    seen = {"requeued": 0, "expired": 0}

    def step():
        for k, v in leases.reap().items():
            seen[k] = seen.get(k, 0) + v
        return seen[key] >= n

    wait_for(step, timeout=timeout, interval=0.25, what=f"the reaper to report {key}")
    return seen


def new_run() -> str:
    return str(uuid.uuid4())


# --- 1. heartbeat ---------------------------------------------------------------------


def test_heartbeat_keeps_a_job_running_past_its_lease(pg, broker, client_app, workers, db):
    mod = client_app(pg, broker, extra_env=SHORT)
    workers(pg, broker, extra_env=SHORT)
    job = mod.steps.submit({"steps": 16, "sleep": 0.5})  # ~8 s: well past a 3 s lease
    assert row(db, job.id)["lease_seconds"] == 3
    reaped = {"requeued": 0, "expired": 0}

    def finished():
        for key, value in mod.leases.reap().items():  # a reaper as eager as it can be
            reaped[key] += value
        j = mod.leases.get(job.id)
        return j if j.terminal else None

    done = wait_for(finished, timeout=90, interval=0.3, what="the long job")
    assert reaped == {"requeued": 0, "expired": 0}
    assert done.status is Status.SUCCEEDED
    assert done.attempt == 1 and done.lease_losses == 0
    assert done.result == {"counted": 16, "resumed_from": 0}
    assert (done.finished_at - done.started_at).total_seconds() > 3  # it did outlive one lease


# --- 2. SIGKILL of a whole worker -----------------------------------------------------


def test_killed_worker_job_is_reaped_and_resumed_from_checkpoint(
        pg, broker, client_app, workers, db, marker_dir):
    mod = client_app(pg, broker, extra_env=MEDIUM)
    w1 = workers(pg, broker, name="w1", extra_env=MEDIUM)
    run_id = new_run()
    job = mod.steps.submit({"steps": 30, "sleep": 0.2, "marker_dir": str(marker_dir)}, run_id=run_id)
    wait_for(lambda: checkpoint_reached(db, job.id, 3), timeout=30, what="checkpoint 3")
    w1.kill(signal.SIGKILL)

    # Nobody holds the job now, but its lease has not elapsed: it stays running.
    assert row(db, job.id)["status"] == "running"
    assert lease_in_future(db, job.id)
    assert mod.leases.reap() == {"requeued": 0, "expired": 0}

    reap_until(mod.leases, "requeued")
    r = row(db, job.id)
    assert r["status"] == "pending" and r["lease_losses"] == 1 and r["attempt"] == 1
    saved = r["checkpoint"]["i"]
    assert saved >= 3
    assert ("reaped", "lease expired: pending") in run_events(db, job.id)

    workers(pg, broker, name="w2", extra_env=MEDIUM)
    done = mod.leases.wait(job.id, timeout=60)
    assert done.status is Status.SUCCEEDED and done.attempt == 2
    assert done.result == {"counted": 30, "resumed_from": saved}
    assert (marker_dir / f"start-2-{saved}").exists()


# --- 3. SIGKILL of one pool child ------------------------------------------------------


def test_killed_pool_child_job_is_reaped_and_finished_by_the_same_worker(
        pg, broker, client_app, workers, db, marker_dir):
    mod = client_app(pg, broker, extra_env=MEDIUM)
    w1 = workers(pg, broker, name="w1", extra_env=MEDIUM)
    run_id = new_run()
    job = mod.steps.submit({"steps": 30, "sleep": 0.2, "marker_dir": str(marker_dir)}, run_id=run_id)
    child = pid_in(marker_dir / "start-1-0")
    wait_for(lambda: checkpoint_reached(db, job.id, 2), timeout=30, what="checkpoint 2")
    assert child in w1.children()
    os.kill(child, signal.SIGKILL)

    reap_until(mod.leases, "requeued")
    done = mod.leases.wait(job.id, timeout=60)
    assert done.status is Status.SUCCEEDED and done.attempt == 2 and done.lease_losses == 1
    assert done.result["resumed_from"] >= 2
    assert w1.proc.poll() is None  # the worker itself survived its child
    owners = [detail for event, detail in run_events(db, job.id) if event == "claimed"]
    assert len(owners) == 2
    assert all(o.startswith("w1@testhost/") for o in owners)
    assert owners[0].split("/")[1] == str(child) and owners[1].split("/")[1] != str(child)


# --- 4. a stale attempt's completion is discarded -------------------------------------


def test_stale_completion_after_reap_is_discarded(pg, broker, client_app, workers, db, marker_dir):
    mod = client_app(pg, broker, extra_env=SHORT)
    w1 = workers(pg, broker, name="w1", concurrency=1, extra_env=SHORT)
    job = mod.sleepy.submit({"sleep": 4, "marker_dir": str(marker_dir)})
    pid_in(marker_dir / f"sleepy-{job.id}-1")
    # Freeze the whole first worker: its heartbeat stops, so does the body, and its
    # main process cannot take the redelivered wakeup.
    os.killpg(w1.pid, signal.SIGSTOP)
    try:
        reap_until(mod.leases, "requeued")
        workers(pg, broker, name="w2", extra_env=SHORT)
        done = mod.leases.wait(job.id, timeout=60)
        assert done.status is Status.SUCCEEDED and done.attempt == 2
        assert effect_rows(db, job.id) == [(job.id, 2)]
    finally:
        os.killpg(w1.pid, signal.SIGCONT)
    # The first attempt wakes past its sleep and tries to record success: refused.
    wait_for(lambda: f"job {job.id}: lease lost; succeeded outcome discarded" in w1.log(),
             timeout=30, what="the stale completion to be refused")
    after = row(db, job.id)
    assert after["status"] == "succeeded" and after["attempt"] == 2
    assert after["finished_at"] == done.finished_at
    assert effect_rows(db, job.id) == [(job.id, 2)]


def test_cancelled_non_cooperative_job_writes_nothing(pg, broker, client_app, workers, db, marker_dir):
    mod = client_app(pg, broker, extra_env=LONG)
    w1 = workers(pg, broker, extra_env=LONG)
    job = mod.sleepy.submit({"sleep": 3, "marker_dir": str(marker_dir)})
    pid_in(marker_dir / f"sleepy-{job.id}-1")
    assert mod.leases.cancel(job.id) is True
    assert mod.leases.get(job.id).status is Status.CANCELLED
    wait_for(lambda: f"job {job.id}: lease lost; succeeded outcome discarded" in w1.log(),
             timeout=30, what="the cancelled job's completion to be refused")
    assert mod.leases.get(job.id).status is Status.CANCELLED
    assert effect_rows(db, job.id) == []
