"""The lease promise in production configurations (issue #9), against real PostgreSQL,
Redis, `celery worker` and `celery beat` processes: maintenance that runs on time
whatever the pool does and whatever beat's clock says, heartbeats across lease lengths
and pools, durability across a PostgreSQL crash, hung connections, lost replies.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone

import pytest
import sqlalchemy as sa

from celery_lease import Status
from celery_lease.db.schema import jobs
from tests.conftest import SUMMARY_LINES, row, wait_for
from tests.harness import faketime

APP = "tests.apps.app_leases"
LONG = {"CL_TEST_LEASE": "300"}
#: beat ticks every second, so a test sees many of them in a few seconds.
FAST_BEAT = {"lease_reap_interval": 1, "lease_sweep_interval": 1, "lease_sweep_stale_seconds": 2}


def status_of(db, job_id: str) -> str:
    return row(db, job_id)["status"]


def expired_lease(make_job, pg, **columns) -> str:
    """A job left running by a worker that is gone, its lease elapsed by the database's clock."""
    values = dict(
        status="running",
        attempt=1,
        lease_generation=1,
        lease_owner="gone@elsewhere/1/boot",
        lease_expires_at=datetime.now(timezone.utc) - timedelta(minutes=30),
        payload={"value": "expired"},
    )
    values.update(columns)
    return make_job(pg, **values)


def summary(request, line: str) -> None:
    request.config.stash.setdefault(SUMMARY_LINES, []).append(line)
    print(line)


# --- maintenance on time (items 9, 11) ----------------------------------------------------


def test_maintenance_ticks_run_while_every_pool_slot_is_busy(
    pg, broker, client_app, workers, beats, db, make_job, tmp_path, request
):
    """Two pool children held by long jobs and job messages prefetched behind them: the
    reaper still runs every tick. (Ticks used to be pool tasks with an ``expires``:
    they waited behind the jobs and were discarded unrun.)"""
    mod = client_app(pg, broker, conf=FAST_BEAT, extra_env=LONG, module=APP)
    # DEBUG: a finished tick is logged at DEBUG ("maintenance tick ... done"), which this test counts.
    w = workers(pg, broker, conf=FAST_BEAT, extra_env=LONG, module=APP, concurrency=2, loglevel="DEBUG")
    gate = tmp_path / "gate"
    busy = [mod.stale.submit({"gate": str(gate), "marker_dir": str(tmp_path)}) for _ in range(2)]
    wait_for(lambda: all(status_of(db, j.id) == "running" for j in busy), timeout=30, what="both pool slots busy")
    queued = mod.echo.submit_many([{"value": i} for i in range(6)])  # prefetched behind the busy slots
    beat = beats(pg, broker, conf=FAST_BEAT, module=APP, loglevel="DEBUG")
    try:
        lost = expired_lease(make_job, pg)
        wait_for(lambda: status_of(db, lost) != "running", timeout=30, what="beat's reaper to requeue the lost job")
        assert status_of(db, lost) == "pending"
        assert all(status_of(db, j.id) == "running" for j in busy)  # the pool was busy all along

        def sends() -> int:
            return beat.log().count("Sending due task celery_lease.reap")

        start_sent, start_ran = sends(), w.log().count("maintenance tick celery_lease.reap done")
        wait_for(lambda: sends() >= start_sent + 10, timeout=60, what="ten more reap ticks from beat")
        sent = sends() - start_sent
        wait_for(
            lambda: w.log().count("maintenance tick celery_lease.reap done") - start_ran >= sent - 2,
            timeout=10,
            what="the worker to run the ticks beat sent",
        )
        ran = w.log().count("maintenance tick celery_lease.reap done") - start_ran
        assert all(status_of(db, j.id) == "running" for j in busy)
        summary(request, f"maintenance with every pool slot busy: reap ticks sent={sent} ran={ran} (before: expired unrun)")
    finally:
        gate.touch()
    for job in [*busy, *queued]:
        assert mod.leases.wait(job.id, timeout=60).status is Status.SUCCEEDED
    assert "Discarding revoked task" not in w.log()


@pytest.mark.skipif(not faketime.available(), reason="needs libfaketime and a C compiler (bash dev.sh test installs them)")
@pytest.mark.parametrize("skew", ["-6s", "-5m", "+5m"])
def test_beat_with_a_skewed_clock_still_reaps_and_sweeps(pg, broker, client_app, workers, beats, db, make_job, skew):
    """Only the database's clock decides: a beat host 6 s or minutes off still gets
    every tick run (an ``expires`` from its clock made a slow beat's ticks arrive
    expired, and maintenance stopped)."""
    mod = client_app(pg, broker, conf=FAST_BEAT, module=APP)
    w = workers(pg, broker, conf=FAST_BEAT, module=APP)
    beat = beats(pg, broker, conf=FAST_BEAT, module=APP, env_hook=lambda env: faketime.skewed_env(skew, env), loglevel="DEBUG")
    lost = expired_lease(make_job, pg)
    never_woken = make_job(pg, payload={"value": "never woken"})
    # Nothing in this process reaps or sweeps: only beat's ticks can finish these.
    assert mod.leases.wait(lost, timeout=60).status is Status.SUCCEEDED
    assert mod.leases.wait(never_woken, timeout=60).status is Status.SUCCEEDED
    assert "Discarding revoked task" not in w.log()
    assert "Sending due task celery_lease.sweep" in beat.log()


# --- the heartbeat across lease lengths and attempts (items 1, 11) --------------------------


def eager_reaper(leases, seen: dict):
    """A reaper as eager as it can be: anything it reaps is a lease the heartbeat let lapse."""

    def step():
        for key, value in leases.reap().items():
            seen[key] = seen.get(key, 0) + value

    return step


@pytest.mark.parametrize("pool", ["solo", "prefork"])
def test_a_short_lease_after_a_long_one_in_the_same_process_is_renewed(pg, broker, client_app, workers, db, tmp_path, pool):
    """A 60 s-lease job, then a 3 s-lease job in the same process: the heartbeat, asleep
    for the 20 s it computed for the first, must wake for the second. (Before the
    regroup it slept on: the short lease lapsed and the reaper took a live job.)"""
    mod = client_app(pg, broker, module=APP)
    workers(pg, broker, module=APP, pool=pool, concurrency=1)
    first = mod.long_lease.submit({"seconds": 0.5})
    assert mod.leases.wait(first.id, timeout=30).status is Status.SUCCEEDED
    second = mod.short_lease.submit({"seconds": 8})
    reaped: dict = {}
    reap = eager_reaper(mod.leases, reaped)

    def finished():
        reap()
        return mod.leases.get(second.id).terminal

    wait_for(finished, timeout=60, interval=0.3, what="the short-lease job")
    done = mod.leases.get(second.id)
    assert reaped.get("requeued", 0) == 0 and reaped.get("expired", 0) == 0, reaped
    assert done.status is Status.SUCCEEDED and done.attempt == 1 and done.lease_losses == 0
    assert done.result["pid"] == mod.leases.get(first.id).result["pid"]  # one process ran both


def test_a_second_attempt_in_the_same_process_does_not_hide_the_first(pg, broker, client_app, workers, db):
    """Attempt 1 of a job is reaped while its handler still runs, and attempt 2 lands in
    another thread of the same process: attempt 1 must still learn that its lease is
    lost. (Keyed by job id alone, attempt 2 replaced attempt 1 in the heartbeat, which
    then never checked attempt 1 again: it ran on believing it held the lease.)"""
    env = {"CL_TEST_LEASE": "3"}
    mod = client_app(pg, broker, extra_env=env, module=APP)
    w = workers(pg, broker, extra_env=env, module=APP, pool="threads", concurrency=2)
    job = mod.poller.submit({"seconds": 30, "then": 0.5})  # attempt 1 polls for 30 s, writing nothing
    wait_for(lambda: row(db, job.id)["status"] == "running", timeout=30, what="attempt 1")

    def lapse_and_reap() -> bool:
        with db.begin() as conn:
            conn.execute(
                sa.update(jobs)
                .where(jobs.c.id == job.id, jobs.c.status == "running", jobs.c.attempt == 1)
                .values(lease_expires_at=sa.func.now() - sa.text("interval '1 second'"))
            )
        return mod.leases.reap()["requeued"] == 1

    wait_for(lapse_and_reap, timeout=30, interval=0.2, what="attempt 1 to be reaped")
    wait_for(lambda: row(db, job.id)["attempt"] == 2, timeout=30, what="attempt 2 in the same worker")
    wait_for(
        lambda: w.log().count(f"job {job.id}: stopped after cancel or lease loss") >= 1,
        timeout=15,
        what="attempt 1 to stop",
    )
    done = mod.leases.wait(job.id, timeout=30)
    assert done.status is Status.SUCCEEDED and done.attempt == 2


# --- durability across a PostgreSQL crash (items 5, 6) ---------------------------------------


@pytest.fixture
def crashable_pg():
    """A private PostgreSQL cluster that the test may crash. Its WAL writer flushes only
    every 10 s, so an asynchronous commit is lost by a crash within that window (as a
    busy server loses the last few hundred milliseconds)."""
    from tests.harness import pgcluster

    if not pgcluster.available():
        pytest.skip("needs PostgreSQL server binaries (bash dev.sh test installs them)")
    with pgcluster.private_cluster(settings={"wal_writer_delay": "10s"}) as cluster:
        yield cluster


def migrated(cluster, name: str = "jobs") -> str:
    from celery_lease.db import migrate
    from celery_lease.db.store import Store
    from tests.apps.app import test_metadata

    url = cluster.create_database(name)
    store = Store(url)
    migrate.upgrade(store)
    test_metadata.create_all(store.durable)
    store.dispose()
    return url


@pytest.mark.timeout(300)
def test_successes_and_claims_survive_a_postgresql_crash(crashable_pg, broker, client_app, workers, tmp_path):
    """Every success read back (leases.get) before a crash of PostgreSQL is still
    succeeded after it, with its effect rows and children; a claim's generation is
    never issued twice. (Claims and completions committed with synchronous_commit=off:
    the crash rolled them back, the job ran again, and its next claim re-issued the
    generation the lost one had.)"""
    from tests.apps.app import effects

    url = migrated(crashable_pg)
    mod = client_app(url, broker, extra_env=LONG, module=APP)
    workers(url, broker, extra_env=LONG, module=APP, concurrency=3)
    engine = sa.create_engine(url)
    try:
        gate = tmp_path / "gate"
        held = mod.stale.submit({"gate": str(gate), "marker_dir": str(tmp_path)})
        plain = mod.echo.submit_many([{"value": i} for i in range(20)])  # batched successes
        parents = [mod.parent.submit({"children": [1, 2]}, run_id=str(uuid.uuid4())) for _ in range(3)]  # children
        with_effect = [mod.sleepy.submit({"sleep": 0.05}) for _ in range(3)]  # effect rows
        seen = {}
        for job in [*plain, *parents, *with_effect]:
            seen[job.id] = mod.leases.wait(job.id, timeout=60)
            assert seen[job.id].status is Status.SUCCEEDED
        claimed = wait_for(lambda: (lambda j: j if j.status is Status.RUNNING else None)(mod.leases.get(held.id)), timeout=30)
        with engine.connect() as conn:
            children = {str(r[0]) for r in conn.execute(sa.select(jobs.c.id).where(jobs.c.parent_id.is_not(None)))}
            effect_jobs = {str(r[0]) for r in conn.execute(sa.select(effects.c.job_id))}
        assert len(children) == 6 and effect_jobs == {j.id for j in with_effect}
        generation = row(engine, held.id)["lease_generation"]

        crashable_pg.crash()
        crashable_pg.start()
        engine.dispose()

        for job_id, before in seen.items():
            after = row(engine, job_id)
            assert after["status"] == "succeeded", (job_id, after["status"])
            assert after["result"] == before.result
        with engine.connect() as conn:
            assert {str(r[0]) for r in conn.execute(sa.select(jobs.c.id).where(jobs.c.parent_id.is_not(None)))} == children
            assert {str(r[0]) for r in conn.execute(sa.select(effects.c.job_id))} == effect_jobs
        after = row(engine, held.id)
        assert (after["status"], after["lease_generation"], after["attempt"]) == ("running", generation, claimed.attempt)

        gate.touch()  # the attempt that held the lease before the crash still holds it
        done = mod.leases.wait(held.id, timeout=60)
        assert done.status is Status.SUCCEEDED and done.attempt == claimed.attempt
        assert row(engine, held.id)["lease_generation"] == generation
    finally:
        engine.dispose()


# --- threads pool, own heartbeat connection, renewal around locks (items 2, 3) -------------


def effect_rows(db, job_id: str) -> list[int]:
    from tests.apps.app import effects

    with db.connect() as conn:
        return [r[0] for r in conn.execute(sa.select(effects.c.attempt).where(effects.c.job_id == job_id))]


def test_threads_pool_of_16_keeps_every_lease_while_one_success_holds_its_row_lock(pg, broker, client_app, workers, db):
    """``--pool threads -c 16`` with 3 s leases: claims, renewals and a slow success
    transaction share one process. Every lease is kept: the heartbeat has its own
    connection (it waited 30 s for one of the 12 pooled ones, and every lease was
    lost), and the renewal skips the row its own process's success transaction has
    locked instead of waiting on it (7 s, while the other leases lapsed)."""
    env = {"CL_TEST_LEASE": "3"}
    mod = client_app(pg, broker, extra_env=env, module=APP)
    workers(pg, broker, extra_env=env, module=APP, pool="threads", concurrency=16)
    pollers = mod.poller.submit_many([{"seconds": 9}] * 15)
    slow = mod.slow_effect.submit({"sleep": 7})
    jobs_ = [*pollers, slow]
    reaped: dict = {}
    reap = eager_reaper(mod.leases, reaped)

    def all_running():
        reap()
        return all(row(db, j.id)["status"] == "running" for j in jobs_)

    wait_for(all_running, timeout=60, interval=0.3, what="16 jobs running at once")

    def finished():
        reap()
        return all(mod.leases.get(j.id).terminal for j in jobs_)

    wait_for(finished, timeout=90, interval=0.3, what="every job to finish")
    assert reaped.get("requeued", 0) == 0 and reaped.get("expired", 0) == 0, reaped
    for job in jobs_:
        done = mod.leases.get(job.id)
        assert done.status is Status.SUCCEEDED and done.attempt == 1 and done.lease_losses == 0, done
    assert effect_rows(db, slow.id) == [1]


# --- a database connection that stops answering (item 4) -------------------------------------


@pytest.fixture
def proxy(pg_proxy):
    """A TCP proxy in front of the shared PostgreSQL, that the test may freeze or cut."""
    return pg_proxy


def test_a_heartbeat_stuck_on_a_silent_connection_stops_the_handler_by_its_own_clock(pg, broker, client_app, workers, db, proxy):
    """The worker's connections stop answering (no error, no reply: a hung server or a
    half-open connection): its heartbeat blocks. The handler must still stop once its
    lease has lapsed by the worker's own clock, before the reaper may hand the job to
    another attempt. (It ran on believing it held the lease.)"""
    env = {"CL_TEST_LEASE": "6"}
    mod = client_app(pg, broker, extra_env=env, module=APP)
    w = workers(proxy.url_for(pg), broker, extra_env=env, module=APP, concurrency=1)
    job = mod.poller.submit({"seconds": 60, "then": 0.5})  # writes nothing: only its clock can tell it
    claimed = wait_for(lambda: (lambda r: r if r["status"] == "running" else None)(row(db, job.id)), timeout=30)
    # Once renewed, the heartbeat's connection is open: the next renewal hangs on it.
    wait_for(lambda: row(db, job.id)["lease_expires_at"] > claimed["lease_expires_at"], timeout=30, what="a renewal")
    proxy.pause()
    try:
        wait_for(
            lambda: f"job {job.id}: stopped after cancel or lease loss" in w.log(),
            timeout=20,
            what="the handler to stop while its connection hangs",
        )
        assert f"job {job.id}: no lease renewal confirmed in time; lease lost" in w.log()
        assert row(db, job.id)["attempt"] == 1  # nobody else has it yet
        wait_for(lambda: mod.leases.reap()["requeued"] == 1, timeout=20, interval=0.25, what="the reaper")
    finally:
        proxy.resume()
    done = mod.leases.wait(job.id, timeout=60)
    assert done.status is Status.SUCCEEDED and done.attempt == 2 and done.lease_losses == 1


# --- lost replies (item 7) ---------------------------------------------------------------------


def test_a_claim_whose_reply_was_lost_runs_the_job_once(pg, broker, client_app, workers, db, proxy, tmp_path):
    """The claim commits, then the worker's connection drops before the reply. The
    retried claim finds the job running under this very worker process and takes that
    attempt. (It took it for a duplicate delivery: the job stayed running with no body
    until its lease expired, and an attempt was spent.)"""
    mod = client_app(pg, broker, module=APP)
    job = mod.echo.submit({"value": "claim", "marker_dir": str(tmp_path)})
    proxy.cut_reply_to(job.id.encode())  # the first statement naming the job: its claim
    w = workers(proxy.url_for(pg), broker, module=APP)
    done = mod.leases.wait(job.id, timeout=60)
    assert proxy.cuts == 1
    assert done.status is Status.SUCCEEDED and done.attempt == 1 and done.lease_losses == 0
    assert done.result == {"echo": "claim", "attempt": 1}
    assert f"job(s) {job.id}: claimed before the reply was lost; adopted" in w.log()
    assert len((tmp_path / f"echo-{job.id}").read_text().split()) == 1  # the body ran once


# --- cancel_run racing new jobs (item 10) -------------------------------------------------------


def test_a_job_committed_into_a_run_after_cancel_run_never_starts(pg, broker, client_app, workers, db, tmp_path):
    """submit(run_id=R, connection=...) is still uncommitted while cancel_run(R) runs;
    then it commits and its wakeup goes out. The job must end cancelled without its
    body ever running. (It ran: the run was cancelled, this job was pending.)"""
    mod = client_app(pg, broker, module=APP)
    workers(pg, broker, module=APP)
    run_id = str(uuid.uuid4())
    first = mod.echo.submit({"value": "first"}, run_id=run_id)
    assert mod.leases.wait(first.id, timeout=30).status is Status.SUCCEEDED
    engine = sa.create_engine(pg)
    try:
        with engine.connect() as conn:
            tx = conn.begin()
            late = mod.echo.submit({"value": "late", "marker_dir": str(tmp_path)}, run_id=run_id, connection=conn)
            assert mod.leases.cancel_run(run_id) == 0  # it cannot see the uncommitted job
            tx.commit()  # publishes the wakeup
    finally:
        engine.dispose()
    done = mod.leases.wait(late.id, timeout=30)
    assert done.status is Status.CANCELLED and done.attempt == 0 and done.started_at is None
    assert not (tmp_path / f"echo-{late.id}").exists()


# --- smaller holes (item 11) -------------------------------------------------------------------


def run_events(db, job_id: str) -> list[tuple[str, str | None]]:
    from celery_lease.db.schema import events

    with db.connect() as conn:
        stmt = sa.select(events.c.event, events.c.detail).where(events.c.job_id == job_id).order_by(events.c.id)
        return [tuple(r) for r in conn.execute(stmt)]


def test_an_attempt_past_its_kinds_timeout_is_stopped_and_retried(pg, broker, client_app, workers, db, tmp_path):
    """A handler that hangs (cooperative or not) held its lease forever: the heartbeat
    renewed it as long as the process lived. With ``timeout=2`` the attempt is given up
    after 2 s and retried at once; with no attempt left the job fails "timed out"."""
    mod = client_app(pg, broker, module=APP)
    w = workers(pg, broker, module=APP, concurrency=3)
    run = str(uuid.uuid4())
    polite = mod.hung.submit({"seconds": 60, "cooperative": True}, run_id=run)
    stubborn = mod.hung.submit({"seconds": 8, "marker_dir": str(tmp_path)}, run_id=run)
    last = mod.hung_once.submit({"seconds": 60})
    for job in (polite, stubborn):
        # Retries are delivered by the sweeper: play beat.
        wait_for(lambda: mod.leases.sweep() >= 0 and mod.leases.get(job.id).terminal, timeout=60, interval=0.3)
        done = mod.leases.get(job.id)
        assert done.status is Status.SUCCEEDED and done.attempt == 2 and done.result == {"attempt": 2}
        assert any(e == "retried" and d.startswith("timed out") for e, d in run_events(db, job.id))
        assert f"job {job.id} (hung) attempt 1 timed out after 2.0s" in w.log()
        assert [(a["attempt"], a["outcome"]) for a in done.attempts] == [(1, "timed out"), (2, "succeeded")]
    failed = mod.leases.wait(last.id, timeout=30)
    assert failed.status is Status.FAILED and failed.error == "timed out" and failed.attempt == 1
    assert [(a["attempt"], a["outcome"]) for a in failed.attempts] == [(1, "timed out")]
    wait_for(lambda: f"job {polite.id}: stopped after cancel or lease loss" in w.log(), timeout=10, what="attempt 1 to stop")
    # The stubborn attempt 1 wakes from its sleep long after: its success is discarded.
    wait_for(
        lambda: (
            f"job {stubborn.id}: lease lost; succeeded outcome discarded" in w.log()
            or f"job {stubborn.id}: lease lost; success discarded" in w.log()
        ),
        timeout=30,
        what="the timed-out attempt's late success to be refused",
    )
    assert mod.leases.get(stubborn.id).result == {"attempt": 2}


@pytest.mark.timeout(300)
def test_checkpoints_and_outcomes_during_a_short_database_restart_cost_no_attempt(crashable_pg, broker, client_app, workers):
    """PostgreSQL restarts (2 s down) while a job checkpoints every 0.2 s: the writes
    wait for it within the lease. (The first failed write raised out of the handler:
    the attempt was spent, or the job left running until reaped.)"""
    url = migrated(crashable_pg)
    env = {"CL_TEST_LEASE": "30"}
    mod = client_app(url, broker, extra_env=env, module=APP)
    workers(url, broker, extra_env=env, module=APP, concurrency=2)
    engine = sa.create_engine(url)
    try:
        job = mod.steps.submit({"steps": 30, "sleep": 0.2})
        plain = mod.poller.submit({"seconds": 4})  # its plain success lands around the restart
        wait_for(lambda: (row(engine, job.id)["checkpoint"] or {}).get("i", 0) >= 3, timeout=30, what="checkpoint 3")
        engine.dispose()
        crashable_pg.restart(downtime=2.0)
        for j in (job, plain):
            done = mod.leases.wait(j.id, timeout=90)
            assert done.status is Status.SUCCEEDED and done.attempt == 1 and done.lease_losses == 0, done
        assert mod.leases.get(job.id).result == {"counted": 30, "resumed_from": 0}
    finally:
        engine.dispose()


# --- the audit: guarded paths a stale attempt really takes (item 9 of the audit) -----------------


def test_every_write_of_a_stale_attempt_is_refused_by_the_database_guard(pg, broker, client_app, workers, db, tmp_path):
    """Attempt 1 of each job is reaped while its handler waits at a gate (its process
    does not know: no renewal is due for 100 s and nothing tells it), attempt 2 runs
    and succeeds; then attempt 1 goes on and tries each kind of write: a batched plain
    success, a failure, a retry, a progress write. Each reaches the database and its
    fence refuses it; the job keeps attempt 2's outcome."""
    mod = client_app(pg, broker, extra_env=LONG, module=APP)
    w = workers(pg, broker, extra_env=LONG, module=APP, pool="threads", concurrency=8)
    gate = tmp_path / "gate"
    ends = ("plain", "fail", "raise", "progress")
    jobs_ = {end: mod.stale.submit({"gate": str(gate), "end": end, "marker_dir": str(tmp_path)}) for end in ends}
    wait_for(lambda: all(row(db, j.id)["status"] == "running" for j in jobs_.values()), timeout=30, what="attempts 1")

    with db.begin() as conn:  # every lease elapses, by the database's clock
        ids = [j.id for j in jobs_.values()]
        conn.execute(sa.update(jobs).where(jobs.c.id.in_(ids)).values(lease_expires_at=sa.func.now() - sa.text("interval '1 s'")))
    assert mod.leases.reap() == {"requeued": 4, "expired": 0}
    for job in jobs_.values():
        done = mod.leases.wait(job.id, timeout=60)
        assert done.status is Status.SUCCEEDED and done.attempt == 2 and done.result == {"attempt": 2}

    gate.touch()
    refused = {
        "plain": "lease lost; success discarded",  # the Completer's batched write
        "fail": "lease lost; failed outcome discarded",
        "raise": "lease lost; error outcome discarded",
        "progress": "lease lost; succeeded outcome discarded",
    }
    for end, job in jobs_.items():
        wait_for(lambda: f"job {job.id}: {refused[end]}" in w.log(), timeout=30, what=f"the stale {end} to be refused")
        after = row(db, job.id)
        assert (after["status"], after["attempt"], after["result"]) == ("succeeded", 2, {"attempt": 2})
        assert after["progress"] is None and after["error"] is None
    # The progress write reached the database (no renewal had told attempt 1 anything),
    # and its refusal is what cancelled the attempt's context.
    assert (tmp_path / f"progress-{jobs_['progress'].id}-cancelled=True").exists()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_a_broker_restart_costs_no_lease_on_prefork_and_threads_workers(pg, redis_server, broker, client_app, workers, db, pool):
    """The heartbeat renews on a thread and a database connection of its own, never
    through the broker, on every pool (gevent: test_green_pools). Four jobs on 3 s leases
    run while the worker's Redis is killed and restarted: each keeps its lease and
    succeeds on its first attempt, and the worker consumes again afterwards."""
    from tests.e2e.test_green_pools import broker_restart_keeps_leases

    broker_restart_keeps_leases(pg, redis_server, client_app, workers, db, pool=pool, count=4)
