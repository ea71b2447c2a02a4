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
from celery_lease.db.schema import events, jobs
from celery_lease.lifecycle import transition as tr
from celery_lease.ops import listing
from tests.apps.app import effects
from tests.conftest import local_pipeline, row, wait_for

SHORT = {"CL_TEST_LEASE": "3"}  # heartbeats every second
MEDIUM = {"CL_TEST_LEASE": "6"}  # heartbeats every two seconds
LONG = {"CL_TEST_LEASE": "300"}  # never expires within a test


def lease_in_future(db, job_id: str) -> bool:
    with db.connect() as conn:
        return conn.execute(sa.select(jobs.c.lease_expires_at > sa.func.now()).where(jobs.c.id == job_id)).scalar()


def effect_rows(db, job_id: str | None = None) -> list[tuple[str, int]]:
    stmt = sa.select(effects.c.job_id, effects.c.attempt).order_by(effects.c.id)
    if job_id is not None:
        stmt = stmt.where(effects.c.job_id == job_id)
    with db.connect() as conn:
        return [tuple(r) for r in conn.execute(stmt)]


def run_events(db, job_id: str) -> list[tuple[str, str | None]]:
    with db.connect() as conn:
        return [
            tuple(r)
            for r in conn.execute(
                sa.select(events.c.event, events.c.detail).where(events.c.job_id == job_id).order_by(events.c.id)
            )
        ]


def checkpoint_reached(db, job_id: str, i: int) -> bool:
    r = row(db, job_id)
    return r["status"] == "running" and (r["checkpoint"] or {}).get("i", 0) >= i


def pid_in(marker) -> int:
    """The pid a handler wrote into its marker file (the pool child running it)."""
    # The handler opens the file and then writes its pid: wait for the pid, not the file
    # (a read between the two found it empty once in a loaded CI run).
    wait_for(lambda: marker.exists() and marker.read_text().strip(), timeout=30, what=f"marker {marker.name}")
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


def test_killed_worker_job_is_reaped_and_resumed_from_checkpoint(pg, broker, client_app, workers, db, marker_dir):
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


def attempts_of(job) -> list[tuple[int, str, str]]:
    """(attempt, worker, outcome) of each entry of a Job's attempt log."""
    return [(a["attempt"], a["worker"], a["outcome"]) for a in job.attempts]


def test_a_job_outside_a_run_lists_every_attempt_with_its_worker_and_outcome(pg, broker, client_app, workers, db, marker_dir):
    mod = client_app(pg, broker, extra_env=MEDIUM)
    w1 = workers(pg, broker, name="w1", extra_env=MEDIUM)
    job = mod.steps.submit({"steps": 30, "sleep": 0.2, "marker_dir": str(marker_dir)})  # no run: no run events
    wait_for(lambda: checkpoint_reached(db, job.id, 2), timeout=30, what="checkpoint 2")
    (running,) = mod.leases.get(job.id).attempts
    assert (running["attempt"], running["worker"], running["outcome"], running["ended_at"]) == (1, "w1@testhost", "running", None)
    w1.kill(signal.SIGKILL)
    reap_until(mod.leases, "requeued")
    workers(pg, broker, name="w2", extra_env=MEDIUM)
    done = mod.leases.wait(job.id, timeout=60)
    assert done.status is Status.SUCCEEDED and done.attempt == 2
    assert attempts_of(done) == [(1, "w1@testhost", "lease expired"), (2, "w2@testhost", "succeeded")]
    first, second = done.attempts
    assert first["started_at"] < first["ended_at"] <= second["started_at"] < second["ended_at"]
    assert run_events(db, job.id) == []  # the log is on the row, not in a run's events
    # What GET /api/v1/jobs/{id} answers: the same attempts; a tenant's token sees no worker.
    view = mod.leases.store.get_view(job.id)
    assert listing.attempts_view(view["attempts"], show_worker=True) == list(done.attempts)
    assert {a["worker"] for a in listing.attempts_view(view["attempts"], show_worker=False)} == {None}


# --- 3. SIGKILL of one pool child ------------------------------------------------------


def test_killed_pool_child_job_is_released_and_finished_by_the_same_worker(pg, broker, client_app, workers, db, marker_dir):
    mod = client_app(pg, broker, extra_env=MEDIUM)
    w1 = workers(pg, broker, name="w1", extra_env=MEDIUM)
    run_id = new_run()
    job = mod.steps.submit({"steps": 30, "sleep": 0.2, "marker_dir": str(marker_dir)}, run_id=run_id)
    child = pid_in(marker_dir / "start-1-0")
    wait_for(lambda: checkpoint_reached(db, job.id, 2), timeout=30, what="checkpoint 2")
    assert child in w1.children()
    os.kill(child, signal.SIGKILL)

    # The worker releases the dead child's lease at once (Celery reports WorkerLostError,
    # worker/dead_processes.py); the reaper would when the lease elapses. Either way it comes back.
    def released() -> bool:
        mod.leases.reap()
        now = mod.leases.get(job.id)
        return now is not None and (now.status is not Status.RUNNING or now.attempt >= 2)

    wait_for(released, timeout=40, interval=0.25, what="the dead child's lease to be released")
    done = mod.leases.wait(job.id, timeout=60)
    assert done.status is Status.SUCCEEDED and done.attempt == 2 and done.lease_losses == 1
    assert done.result["resumed_from"] >= 2
    assert w1.proc.poll() is None  # the worker itself survived its child
    # The dead child's lease elapsed at once (expire_leases_of) and was reaped.
    assert attempts_of(done) == [(1, "w1@testhost", "lease expired"), (2, "w1@testhost", "succeeded")]
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
    wait_for(
        lambda: f"job {job.id}: lease lost; succeeded outcome discarded" in w1.log(),
        timeout=30,
        what="the stale completion to be refused",
    )
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
    wait_for(
        lambda: f"job {job.id}: lease lost; succeeded outcome discarded" in w1.log(),
        timeout=30,
        what="the cancelled job's completion to be refused",
    )
    assert mod.leases.get(job.id).status is Status.CANCELLED
    assert effect_rows(db, job.id) == []


# --- 5. cancel ------------------------------------------------------------------------


def _cancel_running_and_check(mod, w, db, job, cancel) -> None:
    wait_for(lambda: checkpoint_reached(db, job.id, 2), timeout=30, what="checkpoint 2")
    cancel(job.id)
    assert mod.leases.get(job.id).status is Status.CANCELLED  # at once, in the table
    before = row(db, job.id)
    # 100 steps of 0.3 s would run for 30 s more; the handler must stop long before.
    wait_for(
        lambda: f"job {job.id}: stopped after cancel or lease loss" in w.log(),
        timeout=20,
        what="the handler to stop at raise_if_cancelled",
    )
    after = row(db, job.id)
    assert after["status"] == "cancelled"
    assert (after["progress"], after["checkpoint"], after["lease_generation"]) == (
        before["progress"],
        before["checkpoint"],
        before["lease_generation"],
    )
    assert after["checkpoint"]["i"] < 100 and after["result"] is None


def test_cancel_running_job_stops_it_and_discards_its_later_writes(pg, broker, client_app, workers, db):
    mod = client_app(pg, broker, extra_env=SHORT)
    w = workers(pg, broker, extra_env=SHORT)
    job = mod.steps.submit({"steps": 100, "sleep": 0.3})
    _cancel_running_and_check(mod, w, db, job, mod.leases.cancel)
    assert attempts_of(mod.leases.get(job.id)) == [(1, "w1@testhost", "cancelled")]


def _cancel_waiter(pg, broker, client_app, workers, marker_dir, lease, cancel, pool: str = "prefork") -> None:
    import redis

    from celery_lease.broker import cancel_notice

    mod = client_app(pg, broker, extra_env=lease, module="tests.apps.app_faults")
    # The worker listens for notices once it runs a job: a notice published before it
    # subscribed would be missed (the heartbeat, 100 s away with a 300 s lease, is then
    # all that is left). Counted from what is subscribed before it starts: listeners of
    # earlier tests in this process may share the channel.
    client = redis.Redis.from_url(broker)
    name = cancel_notice.channel(mod.app.conf.broker_url, mod.app.main)
    before = client.pubsub_numsub(name)[0][1]
    w = workers(pg, broker, extra_env=lease, module="tests.apps.app_faults", pool=pool)
    job = mod.waiter.submit({"polls": 600, "marker_dir": str(marker_dir)})  # 60 s of polling
    pid_in(marker_dir / f"waiter-{job.id}")
    wait_for(lambda: client.pubsub_numsub(name)[0][1] > before, timeout=20, what="the notice listener")
    cancel(mod, job.id)
    assert mod.leases.get(job.id).status is Status.CANCELLED
    wait_for(
        lambda: f"job {job.id}: stopped after cancel or lease loss" in w.log(),
        timeout=20,
        what="the handler to stop at raise_if_cancelled",
    )
    assert mod.leases.get(job.id).status is Status.CANCELLED


def test_cancel_is_noticed_by_the_heartbeat_alone(pg, broker, client_app, workers, marker_dir):
    # The handler writes nothing, and a pipeline with no notifier sends no notice on
    # Redis: only the heartbeat (every second with a 3 s lease) can tell it.
    def cancel(mod, job_id):
        local_pipeline(mod.leases.store).execute(tr.CANCEL, build={"job_id": job_id})

    _cancel_waiter(pg, broker, client_app, workers, marker_dir, SHORT, cancel)


def test_cancel_notice_reaches_the_worker_before_its_next_heartbeat(pg, broker, client_app, workers, marker_dir):
    # With a 300 s lease the next renewal is 100 s away: only the notice can be this quick.
    _cancel_waiter(pg, broker, client_app, workers, marker_dir, LONG, lambda mod, job_id: mod.leases.cancel(job_id))


def test_cancel_while_workers_are_down_holds_after_restart(pg, broker, client_app, workers, db, marker_dir):
    mod = client_app(pg, broker, extra_env=MEDIUM)
    w1 = workers(pg, broker, name="w1", extra_env=MEDIUM)
    running = mod.steps.submit({"steps": 30, "sleep": 0.2, "marker_dir": str(marker_dir)})
    wait_for(lambda: checkpoint_reached(db, running.id, 1), timeout=30, what="the job to run")
    w1.kill(signal.SIGKILL)
    waiting = mod.echo.submit({"value": 1, "marker_dir": str(marker_dir)})  # wakeup sits in Redis
    assert mod.leases.cancel(running.id) and mod.leases.cancel(waiting.id)
    # Redelivered or duplicated wakeups, as a broker may hand out after an outage.
    mod.app.send_task(running.task, task_id=running.id)

    w1 = workers(pg, broker, name="w1", extra_env=MEDIUM)  # same node: restart recovery runs
    probe = mod.echo.submit({"value": 2})
    assert mod.leases.wait(probe.id, timeout=30).status is Status.SUCCEEDED
    # Every wakeup consumed: the duplicate of the running job's claims nothing; the
    # cancelled echo job's may have claimed the probe (a claim takes what is due of its
    # kind, and the probe's submit may have found that wakeup on its way: broker/waking.py).
    import redis

    client = redis.Redis.from_url(broker)
    try:
        wait_for(
            lambda: client.llen("celery") == 0 and w1.log().count("not claimable") >= 1, timeout=30, what="the wakeups consumed"
        )
    finally:
        client.close()
    mod.leases.reap()
    mod.leases.sweep()
    for job in (running, waiting):
        r = row(db, job.id)
        assert r["status"] == "cancelled" and r["lease_owner"] is None
    assert row(db, running.id)["attempt"] == 1 and row(db, waiting.id)["attempt"] == 0
    assert not (marker_dir / f"echo-{waiting.id}").exists()
    assert not (marker_dir / "start-2-0").exists() and not list(marker_dir.glob("start-2-*"))


def test_cancel_run_cancels_every_non_terminal_job(pg, broker, client_app, workers, db):
    from celery_lease.errors import LeaseError

    mod = client_app(pg, broker, extra_env=MEDIUM)
    w = workers(pg, broker, concurrency=2, extra_env=MEDIUM)
    run_id = new_run()
    finished = mod.echo.submit({"value": 0}, run_id=run_id)
    assert mod.leases.wait(finished.id, timeout=30).status is Status.SUCCEEDED
    running = [mod.steps.submit({"steps": 100, "sleep": 0.3}, run_id=run_id) for _ in range(2)]
    wait_for(lambda: all(checkpoint_reached(db, j.id, 1) for j in running), timeout=30, what="two jobs running")
    queued = mod.steps.submit({"steps": 1}, run_id=run_id)  # both pool slots are busy
    delayed = mod.echo.submit({"value": 9}, run_id=run_id, run_after=600)
    other = mod.echo.submit({"value": 5}, run_after=600)  # another run is untouched

    assert mod.leases.cancel_run(run_id) == 4
    for job in (*running, queued, delayed):
        assert mod.leases.get(job.id).status is Status.CANCELLED
    assert mod.leases.get(finished.id).status is Status.SUCCEEDED
    assert mod.leases.get(other.id).status is Status.PENDING
    for job in running:
        wait_for(
            lambda: f"job {job.id}: stopped after cancel or lease loss" in w.log(), timeout=20, what="running handlers to stop"
        )
    assert ("cancelled", None) in run_events(db, queued.id)
    with pytest.raises(LeaseError):
        mod.echo.submit({"value": 1}, run_id=run_id)
    assert mod.leases.cancel_run(run_id) == 0


# --- 6. deploy handoff ------------------------------------------------------------------


@pytest.mark.parametrize("pool", ["prefork", "gevent", pytest.param("eventlet", marks=pytest.mark.slow)])
def test_warm_shutdown_hands_the_job_to_another_worker(pg, broker, client_app, workers, db, marker_dir, pool):
    mod = client_app(pg, broker, extra_env=LONG)
    w1 = workers(pg, broker, name="w1", extra_env=LONG, pool=pool)
    run_id = new_run()
    job = mod.steps.submit({"steps": 40, "sleep": 0.2, "marker_dir": str(marker_dir)}, run_id=run_id)
    wait_for(lambda: checkpoint_reached(db, job.id, 3), timeout=30, what="checkpoint 3")
    w1.stop()

    # Back to pending at once (the 300 s lease is irrelevant), attempt not spent.
    r = row(db, job.id)
    assert r["status"] == "pending" and r["attempt"] == 0 and r["lease_owner"] is None
    assert r["lease_losses"] == 0
    saved = r["checkpoint"]["i"]
    assert saved >= 3
    assert ("requeued", "shutdown handoff") in run_events(db, job.id)

    workers(pg, broker, name="w2", extra_env=LONG)
    done = mod.leases.wait(job.id, timeout=60)
    assert done.status is Status.SUCCEEDED and done.attempt == 1
    assert done.result == {"counted": 40, "resumed_from": saved}
    # The handed-off attempt was given back: the next claim is attempt 1 again.
    assert attempts_of(done) == [(1, "w1@testhost", "handed off"), (1, "w2@testhost", "succeeded")]


# --- 7. restart recovery --------------------------------------------------------------


def test_restarted_worker_requeues_its_interrupted_job_at_once(pg, broker, client_app, workers, db, marker_dir):
    mod = client_app(pg, broker, extra_env=LONG)
    w1 = workers(pg, broker, name="w1", extra_env=LONG)
    run_id = new_run()
    job = mod.steps.submit({"steps": 30, "sleep": 0.2, "marker_dir": str(marker_dir)}, run_id=run_id)
    wait_for(lambda: checkpoint_reached(db, job.id, 2), timeout=30, what="checkpoint 2")
    w1.kill(signal.SIGKILL)
    assert mod.leases.reap() == {"requeued": 0, "expired": 0}  # the lease has ~300 s left

    workers(pg, broker, name="w1", extra_env=LONG)  # the same node name, a new boot
    done = mod.leases.wait(job.id, timeout=60)  # far sooner than the lease would expire
    assert done.status is Status.SUCCEEDED and done.attempt == 2 and done.lease_losses == 1
    assert done.result["resumed_from"] >= 2
    assert ("requeued", "interrupted by restart: pending") in run_events(db, job.id)
    assert attempts_of(done) == [(1, "w1@testhost", "interrupted"), (2, "w1@testhost", "succeeded")]


def test_restart_recovery_fails_a_job_with_no_attempts_left(pg, broker, workers, db, make_job):
    lease_end = datetime.now(timezone.utc) + timedelta(seconds=300)
    common = dict(
        kind="steps",
        task="tests.apps.app.steps",
        status="running",
        lease_generation=1,
        lease_expires_at=lease_end,
        payload={"steps": 1, "sleep": 0},
    )
    spent = make_job(pg, attempt=1, max_attempts=1, lease_owner="w1@testhost/4242/oldboot", **common)
    retry = make_job(pg, attempt=1, max_attempts=3, lease_owner="w1@testhost/4242/oldboot", **common)
    elsewhere = make_job(pg, attempt=1, max_attempts=1, lease_owner="w10@testhost/4242/oldboot", **common)

    workers(pg, broker, name="w1")
    r = wait_for(
        lambda: (lambda r: r if r["status"] != "running" else None)(row(db, spent)), timeout=30, what="recovery of the spent job"
    )
    assert r["status"] == "failed" and r["error"] == "interrupted by restart"
    assert r["lease_owner"] is None and r["lease_losses"] == 1
    done = wait_for(
        lambda: (lambda r: r if r["status"] == "succeeded" else None)(row(db, retry)),
        timeout=30,
        what="the requeued job to finish",
    )
    assert done["attempt"] == 2
    other = row(db, elsewhere)  # another node's job is not this worker's to recover
    assert other["status"] == "running" and other["lease_owner"] == "w10@testhost/4242/oldboot"


# --- 8. sweeper -----------------------------------------------------------------------


def queue_length(redis_server, queue: str = "celery") -> int:
    import redis

    return redis.Redis(port=redis_server.port).llen(queue)


def test_sweeper_delivers_lost_wakeups_once_stale(pg, broker, redis_server, client_app, workers, db, make_job):
    # One job per delivery: a claim of what is due (waking.py) would take the job whose
    # wakeup was lost with the other's, before any sweep.
    conf = {"lease_sweep_stale_seconds": 5, "lease_coalesce_wakeups": False}
    mod = client_app(pg, broker, conf=conf)
    job = mod.echo.submit({"value": 1})
    redis_server.flush()  # its wakeup is lost
    never_woken = make_job(pg, payload={"value": 2})  # committed, never published
    assert mod.leases.sweep() == 1  # only the one without any wakeup; the other's is recent
    assert queue_length(redis_server) == 1

    workers(pg, broker, conf=conf)
    assert mod.leases.wait(never_woken, timeout=30).status is Status.SUCCEEDED
    assert row(db, job.id)["status"] == "pending"  # nothing else will wake it...
    wait_for(lambda: mod.leases.sweep() == 1, timeout=30, interval=0.5, what="its wakeup to go stale")
    done = mod.leases.wait(job.id, timeout=30)  # ...but the sweeper does
    assert done.status is Status.SUCCEEDED and done.attempt == 1


def test_delayed_job_is_not_claimable_early_and_is_swept_when_due(pg, broker, redis_server, client_app, workers, db, marker_dir):
    mod = client_app(pg, broker)
    # Due in ten minutes, whatever the worker's boot takes; made due below by the test.
    job = mod.echo.submit({"value": 1, "marker_dir": str(marker_dir)}, run_after=600)
    assert queue_length(redis_server) == 0  # no ETA message parked in Redis
    assert row(db, job.id)["woken_at"] is None
    w = workers(pg, broker)
    mod.app.send_task(job.task, task_id=job.id)  # a wakeup before it is due
    wait_for(lambda: f"job {job.id}: duplicate or not claimable" in w.log(), timeout=30, what="the early wakeup to be consumed")
    r = row(db, job.id)
    assert r["status"] == "pending" and r["attempt"] == 0
    assert not (marker_dir / f"echo-{job.id}").exists()
    assert mod.leases.sweep() == 0  # not due yet

    with db.begin() as conn:  # its time comes
        conn.execute(sa.update(jobs).where(jobs.c.id == job.id).values(run_after=sa.func.now()))
    due_at = row(db, job.id)["run_after"]
    assert mod.leases.sweep() == 1
    done = mod.leases.wait(job.id, timeout=30)
    assert done.status is Status.SUCCEEDED and done.attempt == 1
    assert done.started_at >= due_at


def test_submit_while_redis_is_down_is_delivered_by_the_sweeper_later(pg, broker, redis_server, client_app, workers, db):
    mod = client_app(pg, broker)
    redis_server.stop()
    try:
        job = mod.echo.submit({"value": 1})  # must not raise: the row is the truth
        r = row(db, job.id)
        assert r["status"] == "pending" and r["woken_at"] is None  # left to the sweeper
    finally:
        redis_server.start()
    workers(pg, broker)

    def delivered():
        mod.leases.sweep()
        return mod.leases.get(job.id).terminal

    wait_for(delivered, timeout=40, interval=0.5, what="the sweeper to deliver the job")
    done = mod.leases.get(job.id)
    assert done.status is Status.SUCCEEDED and done.attempt == 1


def _concurrently(fn, n: int = 4) -> list:
    barrier = threading.Barrier(n)
    results: list = [None] * n

    def call(i):
        barrier.wait()
        results[i] = fn()

    threads = [threading.Thread(target=call, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_concurrent_sweeps_never_publish_a_wakeup_twice(pg, broker, redis_server, client_app, make_job):
    mod = client_app(pg, broker, conf={"lease_batch_size": 7})
    ids = [make_job(pg, payload={"value": i}) for i in range(150)]
    sent = _concurrently(mod.leases.sweep)
    assert sum(sent) == len(ids)
    assert queue_length(redis_server) == len(ids)


def test_concurrent_reaps_never_requeue_a_job_twice(pg, broker, redis_server, client_app, make_job, db):
    mod = client_app(pg, broker, conf={"lease_batch_size": 7})
    expired = datetime.now(timezone.utc) - timedelta(seconds=5)
    ids = [
        make_job(
            pg,
            status="running",
            attempt=1,
            lease_generation=1,
            lease_owner="gone@host/1/x",
            lease_expires_at=expired,
            payload={"value": i},
        )
        for i in range(150)
    ]
    counts = _concurrently(mod.leases.reap)
    assert sum(c["requeued"] for c in counts) == len(ids)
    assert sum(c["expired"] for c in counts) == 0
    assert queue_length(redis_server) == len(ids)
    with db.connect() as conn:
        states = set(conn.execute(sa.select(jobs.c.status, jobs.c.lease_generation, jobs.c.lease_losses)))
    assert states == {("pending", 2, 1)}


# --- 9. PostgreSQL faults ---------------------------------------------------------------


def terminate_worker_backends(admin) -> int:
    """Terminate every celery-lease connection to the test database but this one."""
    with admin.connect() as conn:
        return conn.execute(
            sa.text(
                "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND application_name = 'celery-lease' "
                "AND pid <> pg_backend_pid()"
            )
        ).scalar()


def assert_clean_outcome(db, ids: list[str]) -> dict[str, int]:
    """Every job terminal and consistent; exactly one effect per success; returns counts."""
    with db.connect() as conn:
        rows = {str(r["id"]): r for r in conn.execute(sa.select(jobs).where(jobs.c.id.in_(ids))).mappings()}
        doubled = conn.execute(sa.select(effects.c.job_id).group_by(effects.c.job_id).having(sa.func.count() > 1)).all()
    assert len(rows) == len(ids)
    assert doubled == []
    by_job = dict(effect_rows(db))
    counts: dict[str, int] = {}
    for job_id, r in rows.items():
        counts[r["status"]] = counts.get(r["status"], 0) + 1
        assert r["status"] in ("succeeded", "expired", "failed"), (job_id, r["status"])
        assert r["lease_owner"] is None and r["lease_expires_at"] is None and r["finished_at"] is not None
        assert 1 <= r["attempt"] <= r["max_attempts"]
        if r["status"] == "succeeded":
            assert r["result"] is not None and r["checkpoint"] is None
            assert by_job.get(job_id) == r["attempt"]  # written by the attempt that won
        else:
            assert job_id not in by_job
    return counts


def drive_until_terminal(leases, db, ids: list[str], timeout: float) -> None:
    """Play beat: reap and sweep until every job is terminal."""

    def done():
        leases.reap()
        leases.sweep()
        with db.connect() as conn:
            return (
                conn.execute(
                    sa.select(sa.func.count()).where(jobs.c.id.in_(ids), jobs.c.status.in_(["pending", "running"]))
                ).scalar()
                == 0
            )

    wait_for(done, timeout=timeout, interval=0.5, what="every job to finish")


def test_terminated_database_backends_neither_corrupt_nor_hang(pg, broker, client_app, workers, db):
    conf = {"lease_sweep_stale_seconds": 3}
    env = {**SHORT, "CL_CHAOS_ATTEMPTS": "8"}
    mod = client_app(pg, broker, conf=conf, extra_env=env, module="tests.apps.app_faults")
    ws = [workers(pg, broker, name=f"w{i}", conf=conf, extra_env=env, module="tests.apps.app_faults") for i in (1, 2)]
    ids = [j.id for j in mod.chaos.submit_many([{"steps": 4, "sleep": 0.15}] * 40)]
    admin = sa.create_engine(pg, isolation_level="AUTOCOMMIT")
    terminated = 0
    try:
        # Claims, checkpoints, heartbeats and completions are all in flight meanwhile.
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            terminated += terminate_worker_backends(admin)
            time.sleep(0.3)
    finally:
        admin.dispose()
    assert terminated > 0
    drive_until_terminal(mod.leases, db, ids, timeout=120)
    counts = assert_clean_outcome(db, ids)
    assert counts.get("succeeded", 0) == len(ids)
    assert all(w.proc.poll() is None for w in ws)
    # Both workers still take work: no pool child is wedged on a dead connection.
    probes = [j.id for j in mod.chaos.submit_many([{"steps": 1, "sleep": 0.5}] * 8)]
    for job_id in probes:
        assert mod.leases.wait(job_id, timeout=60).status is Status.SUCCEEDED


# --- 10. beat drives the reaper and the sweeper -----------------------------------------


def test_beat_reaps_and_sweeps_end_to_end(pg, broker, client_app, workers, beats, db, make_job):
    beat_reaps_and_sweeps(pg, broker, client_app, workers, beats, db, make_job)


def beat_reaps_and_sweeps(pg, broker, client_app, workers, beats, db, make_job) -> None:
    """A worker SIGKILLed mid-job and a job whose wakeup was never sent: only beat's
    reaper and sweeper ticks can finish them (tests/e2e/test_rabbitmq.py on RabbitMQ)."""
    conf = {"lease_reap_interval": 1, "lease_sweep_interval": 1, "lease_sweep_stale_seconds": 2}
    mod = client_app(pg, broker, conf=conf, extra_env=SHORT)
    w1 = workers(pg, broker, name="w1", conf=conf, extra_env=SHORT)
    beat = beats(pg, broker, conf=conf)
    job = mod.steps.submit({"steps": 20, "sleep": 0.2})
    wait_for(lambda: checkpoint_reached(db, job.id, 2), timeout=30, what="checkpoint 2")
    w1.kill(signal.SIGKILL)
    never_woken = make_job(pg, payload={"value": 1})

    workers(pg, broker, name="w2", conf=conf, extra_env=SHORT)  # another node: no recovery
    # Nothing in this process reaps or sweeps: only beat's ticks can finish these.
    done = mod.leases.wait(job.id, timeout=90)
    assert done.status is Status.SUCCEEDED and done.attempt == 2 and done.lease_losses == 1
    assert mod.leases.wait(never_woken, timeout=60).status is Status.SUCCEEDED
    # (Only beat's ticks could have done that; they are DEBUG lines, not one INFO line each.)
    assert "Sending due task celery_lease.reap" not in beat.log() and "beat: Starting" in beat.log()
