"""The claim made ahead of the pool (lease_claim_ahead, celery_lease/worker/ahead.py), on
real prefork workers: the main process claims in batches, its children run the leases
it hands them, and a SIGKILL of either loses nothing. The randomized guarantee test
runs on this path too (tests/e2e/test_history.py, the ``ahead`` variant).
"""

from __future__ import annotations

import os
import signal

import pytest
import sqlalchemy as sa

from celery_lease import Status
from tests.conftest import wait_for
from tests.e2e.test_faults import MEDIUM, checkpoint_reached, new_run, pid_in, run_events

AHEAD = {"lease_claim_ahead": True}


@pytest.fixture
def db(pg):
    engine = sa.create_engine(pg)
    yield engine
    engine.dispose()


def claimers(db, job_id: str) -> list[str]:
    """The pid of each claim's lease owner (node/pid/boot)."""
    return [detail.split("/")[1] for event, detail in run_events(db, job_id) if event == "claimed"]


def test_the_main_process_claims_and_skips_a_duplicate_without_the_pool(pg, broker, client_app, workers, db):
    mod = client_app(pg, broker, conf=AHEAD)
    w1 = workers(pg, broker, conf=AHEAD)
    run_id = new_run()
    jobs = mod.echo.submit_many([{"i": i} for i in range(20)], run_id=run_id)
    done = [mod.leases.wait(job.id, timeout=60) for job in jobs]
    assert all(d.status is Status.SUCCEEDED and d.attempt == 1 for d in done)
    assert all(claimers(db, job.id) == [str(w1.pid)] for job in jobs)
    # A duplicate wakeup of a finished job: the batch claims nothing, the main process
    # acks it and no pool process sees it (a child would have logged the skip).
    mod.leases.publish_wakeups([jobs[0]])
    wait_for(lambda: "duplicate or not claimable" in w1.log(), timeout=20, what="the duplicate skipped")
    assert mod.leases.get(jobs[0].id).attempt == 1
    assert f"{jobs[0].id}: duplicate" in w1.log() and "ForkPoolWorker" not in _line(w1.log(), "duplicate")


def _line(log: str, needle: str) -> str:
    return next(line for line in log.splitlines() if needle in line)


def test_a_killed_pool_child_releases_the_lease_the_main_process_claimed(pg, broker, client_app, workers, db, marker_dir):
    mod = client_app(pg, broker, conf=AHEAD, extra_env=MEDIUM)
    w1 = workers(pg, broker, conf=AHEAD, extra_env=MEDIUM)
    job = mod.steps.submit({"steps": 30, "sleep": 0.2, "marker_dir": str(marker_dir)}, run_id=new_run())
    child = pid_in(marker_dir / "start-1-0")
    wait_for(lambda: checkpoint_reached(db, job.id, 2), timeout=30, what="checkpoint 2")
    assert child in w1.children()
    os.kill(child, signal.SIGKILL)
    # Released at once by the main process (its own lease, worker/lost.py), claimed
    # again ahead and finished by another child; the reaper is never needed.
    done = mod.leases.wait(job.id, timeout=60)
    assert done.status is Status.SUCCEEDED and done.attempt == 2 and done.lease_losses == 1
    assert done.result["resumed_from"] >= 2
    assert w1.proc.poll() is None
    assert claimers(db, job.id) == [str(w1.pid), str(w1.pid)]


def test_a_killed_main_process_loses_nothing(pg, broker, client_app, workers, db, marker_dir):
    mod = client_app(pg, broker, conf=AHEAD, extra_env=MEDIUM)
    w1 = workers(pg, broker, conf=AHEAD, extra_env=MEDIUM)
    job = mod.steps.submit({"steps": 30, "sleep": 0.2, "marker_dir": str(marker_dir)}, run_id=new_run())
    wait_for(lambda: checkpoint_reached(db, job.id, 3), timeout=30, what="checkpoint 3")
    # A stream of wakeups, then the main process dies mid-batch: some claimed and not
    # yet handed to the pool, some not claimed, some running in an orphaned child.
    echoes = mod.echo.submit_many([{"i": i} for i in range(60)])
    os.kill(w1.pid, signal.SIGKILL)
    workers(pg, broker, name="w2", conf=AHEAD, extra_env=MEDIUM)

    def all_ended() -> bool:
        mod.leases.reap()
        mod.leases.sweep()
        return all(mod.leases.get(j.id).terminal for j in [job, *echoes])

    wait_for(all_ended, timeout=90, interval=0.5, what="every job to end")
    assert all(mod.leases.get(j.id).status is Status.SUCCEEDED for j in [job, *echoes])
