"""Transitions under faults, with real workers (#18 item 6 and its reasoned items):
timeouts written off the heartbeat thread, a timed-out handler's slot freed once at its
timeout, a snooze that is durable and retried through a database restart."""

from __future__ import annotations

import threading
import time

import pytest
import sqlalchemy as sa

from celery_lease import Status
from tests.conftest import row, wait_for
from tests.e2e.test_worker_liveness_faults import crashable_pg, eager_reaper, effect_rows, migrated  # noqa: F401

APP = "tests.apps.app_leases"


def test_a_timeout_inside_its_own_success_transaction_does_not_stop_other_renewals(pg, broker, client_app, workers, db):
    """A job whose 1 s timeout strikes while its own success transaction holds its row:
    the timeout's write waits on that lock. It ran on the heartbeat thread with no lock
    timeout, so no other lease of the process was renewed meanwhile (3 s leases lapsed
    and were reaped). Now the heartbeat only renews."""
    env = {"CL_TEST_LEASE": "3"}
    mod = client_app(pg, broker, extra_env=env, module=APP)
    workers(pg, broker, extra_env=env, module=APP, pool="threads", concurrency=4)
    pollers = mod.poller.submit_many([{"seconds": 9}] * 3)
    wait_for(lambda: all(row(db, p.id)["status"] == "running" for p in pollers), timeout=60, what="the pollers to run")
    slow = mod.slow_timeout.submit({"sleep": 5})
    reaped: dict = {}
    reap = eager_reaper(mod.leases, reaped)

    def finished():
        reap()
        return all(mod.leases.get(j.id).terminal for j in (*pollers, slow))

    wait_for(finished, timeout=90, interval=0.3, what="every job to finish")
    assert reaped.get("requeued", 0) == 0 and reaped.get("expired", 0) == 0, reaped
    for job in pollers:
        done = mod.leases.get(job.id)
        assert done.status is Status.SUCCEEDED and done.attempt == 1 and done.lease_losses == 0, done
    # The slow success held its row: it committed, the timeout's retry found it succeeded.
    assert mod.leases.get(slow.id).status is Status.SUCCEEDED and effect_rows(db, slow.id) == [1]


def test_a_timed_out_handler_is_fenced_and_its_slot_freed_at_the_timeout(pg, broker, client_app, workers, tmp_path):
    """``concurrency=1``, timeout 1 s: attempt 1 of A sleeps through its timeout (it does
    not cooperate). Its slot is freed by the timeout's transition, once: the held job B
    starts while A's handler still sleeps (before: only when the handler returned, 6 s
    later), and A's late success is discarded; A's retry then runs."""
    mod = client_app(pg, broker, module=APP)
    w = workers(pg, broker, module=APP, concurrency=2)
    marks = tmp_path / "marks"
    marks.mkdir()
    a = mod.hung_limited.submit({"hang": 6, "marker_dir": str(marks)})
    wait_for(lambda: (marks / f"hl-{a.id}-1").exists(), timeout=30, what="A to start")
    started = time.monotonic()
    b = mod.hung_limited.submit({"marker_dir": str(marks)})
    wait_for(lambda: (marks / f"hl-{b.id}-1").exists(), timeout=30, what="B to start")
    took = time.monotonic() - started
    assert not (marks / f"hl-late-{a.id}").exists() and took < 4.5, took  # A's handler still sleeps
    assert mod.leases.wait(b.id, timeout=30).status is Status.SUCCEEDED

    def a_done():
        mod.leases.sweep()  # A's retry is delivered by the sweeper: play beat
        return mod.leases.get(a.id).terminal

    wait_for(a_done, timeout=60, interval=0.3, what="A's retry to finish")
    done = mod.leases.get(a.id)
    assert done.status is Status.SUCCEEDED and done.attempt == 2 and done.result == {"attempt": 2}, done
    wait_for(lambda: (marks / f"hl-late-{a.id}").exists(), timeout=30, what="A's attempt 1 to wake")
    refused = f"job {a.id}: lease lost; succeeded outcome discarded"
    wait_for(lambda: refused in w.log(), timeout=30, what="its late success refused")


@pytest.mark.timeout(300)
def test_a_snooze_rides_out_a_database_restart_and_survives_a_crash(crashable_pg, broker, client_app, workers, tmp_path):  # noqa: F811
    """``max_attempts=1`` jobs snooze once. One snoozes while PostgreSQL is down (before:
    the write raised, the job stayed running until the reaper spent its only attempt);
    the other's snooze is read back and PostgreSQL then crashes (before: committed
    asynchronously, the crash took it back to running). Both still run to success."""
    url = migrated(crashable_pg)
    mod = client_app(url, broker, module=APP)
    workers(url, broker, module=APP, concurrency=2)
    engine = sa.create_engine(url)
    try:
        gates = [tmp_path / "gate-outage", tmp_path / "gate-crash"]
        outage, crash = (mod.snooze_gate.submit({"gate": str(g), "marker_dir": str(tmp_path)}) for g in gates)
        wait_for(lambda: all(row(engine, j.id)["status"] == "running" for j in (outage, crash)), timeout=30, what="both to run")
        engine.dispose()
        restart = threading.Thread(target=crashable_pg.restart, kwargs={"downtime": 3.0})
        restart.start()
        wait_for(lambda: not crashable_pg.is_running(), timeout=30, what="PostgreSQL to stop")
        gates[0].touch()  # the snooze is written while the database is down
        restart.join()
        wait_for(lambda: row(engine, outage.id)["status"] == "pending", timeout=60, what="the snooze to land after the restart")
        gates[1].touch()
        wait_for(lambda: row(engine, crash.id)["status"] == "pending", timeout=30, what="the second snooze")
        engine.dispose()
        crashable_pg.restart(crash=True)
        for job in (outage, crash):
            r = row(engine, job.id)
            assert (r["status"], r["attempt"]) == ("pending", 0), r  # no attempt spent, nothing lost
        engine.dispose()

        def finished():
            mod.leases.sweep()  # snoozed jobs are woken by the sweeper when due: play beat
            return all(mod.leases.get(j.id).terminal for j in (outage, crash))

        wait_for(finished, timeout=60, interval=0.3, what="both jobs to finish")
        for job in (outage, crash):
            done = mod.leases.get(job.id)
            assert done.status is Status.SUCCEEDED and done.attempt == 1, done
    finally:
        engine.dispose()
