"""Celery habits on leased tasks against real `celery worker` / `celery beat` processes,
PostgreSQL and Redis: beat after Django-style configuration, canvas, AsyncResult (an
app's own result backend too), revoke and the events Flower reads."""

from __future__ import annotations

import re
import uuid

import sqlalchemy as sa

from celery_lease import Status
from celery_lease.db.schema import jobs
from tests.conftest import wait_for

DJANGO = "tests.apps.app_django"


def _count(db: str, *where) -> int:
    engine = sa.create_engine(db)
    try:
        with engine.connect() as conn:
            return conn.execute(sa.select(sa.func.count()).select_from(jobs).where(*where)).scalar_one()
    finally:
        engine.dispose()


# --- beat ------------------------------------------------------------------------------------


def test_beat_started_after_django_style_config_reaps_a_killed_workers_job(pg, broker, client_app, workers, beats, tmp_path):
    late = {"CL_TEST_LATE_SCHEDULE": "1", "CL_TEST_LEASE": "3"}
    mod = client_app(pg, broker, module=DJANGO, extra_env=late)
    # The project's `app.conf.beat_schedule = {...}` replaced celery-lease's entries.
    assert "celery_lease.reap" not in mod.app.conf.beat_schedule
    w1 = workers(pg, broker, name="w1", module=DJANGO, extra_env=late)
    marker = tmp_path / "attempts"
    job = mod.dj_sleep.submit({"sleep": 120, "marker": str(marker)})
    wait_for(lambda: marker.exists(), timeout=30, what="the first attempt to start")
    w1.kill()
    assert mod.leases.get(job.id).status is Status.RUNNING  # orphaned under a dead lease
    w2 = workers(pg, broker, name="w2", module=DJANGO, extra_env=late)
    # Nothing reaps until beat runs; beat is started only now, after all configuration.
    beat = beats(pg, broker, module=DJANGO)

    def reaped_and_rerun():
        current = mod.leases.get(job.id)
        return current if current.attempt >= 2 else None

    rerun = wait_for(reaped_and_rerun, timeout=60, interval=0.2, what="the reaper to requeue the killed job")
    assert rerun.lease_losses == 1
    mod.leases.cancel(job.id)  # the second attempt would sleep too; the reap is what counts
    log = beat.log()
    assert re.search(r"beat schedule had no .*celery_lease\.reap", log), log[-3000:]
    # The periodic leased job declared before configuration is submitted by this beat too.
    wait_for(lambda: _count(pg, jobs.c.kind == "dj_tick") >= 1, timeout=30, what="a periodic dj_tick job")
    # Maintenance ticks ran (the reap above) without one INFO line each.
    assert "Sending due task celery_lease." not in log
    assert "Task celery_lease.reap[" not in w2.log() and "Task celery_lease.sweep[" not in w2.log()
    assert "Task tests.apps.app_django.dj_tick[" in w2.log()  # other tasks keep their INFO lines


# --- canvas ----------------------------------------------------------------------------------

NATIVE = "tests.apps.app_native"


def _effects(db: str) -> list[str]:
    engine = sa.create_engine(db)
    try:
        with engine.connect() as conn:
            return sorted(r[0] for r in conn.execute(sa.text("SELECT note FROM test_effects")))
    finally:
        engine.dispose()


def test_chain_of_leased_steps_passes_results_and_survives_a_worker_sigkill(pg, broker, client_app, workers, tmp_path):
    from celery import chain

    mod = client_app(pg, broker, module=NATIVE, conf={"lease_reap_interval": 0.5})
    w1 = workers(pg, broker, name="w1", module=NATIVE, extra_env={"CL_TEST_LEASE": "3"})
    res = chain(mod.inc.s({"n": 1, "slow_at": 2, "dir": str(tmp_path)}), mod.inc.s(), mod.inc.s()).apply_async()
    # Step 2's first attempt is running: kill the worker under it.
    wait_for(lambda: (tmp_path / "inc-2-1").exists(), timeout=30, what="step 2 to start")
    w1.kill()
    workers(pg, broker, name="w2", module=NATIVE, extra_env={"CL_TEST_LEASE": "3"})

    def reap():
        mod.leases.reap()
        return res.ready()

    wait_for(reap, timeout=60, interval=0.3, what="the chain to finish after the reap")
    assert res.get(timeout=5)["n"] == 4
    # Each step is one job (its frozen task id), ran to success once: one effect each.
    assert _count(pg) == 3
    assert _effects(pg) == ["inc 1", "inc 2", "inc 3"]
    step2 = mod.leases.get(res.parent.id)
    assert step2.attempt == 2 and step2.lease_losses == 1 and step2.parent_id == res.parent.parent.id
    assert res.parent.parent.get(timeout=5)["n"] == 2


def test_plain_and_leased_steps_mix_in_one_chain_both_ways(pg, broker, client_app, workers, tmp_path):
    from celery import chain

    mod = client_app(pg, broker, module=NATIVE)
    workers(pg, broker, module=NATIVE)
    # plain -> leased: the plain task's worker applies the leased step, which submits it.
    first = chain(mod.plain_add.si(1, 2), mod.inc.s()).apply_async()
    assert first.get(timeout=30) == {"n": 4}
    assert mod.leases.get(first.id).status is Status.SUCCEEDED
    # leased -> plain -> leased: the plain step is sent after the leased success commits.
    second = chain(mod.inc.s({"n": 1, "dir": str(tmp_path)}), mod.plain_bump.s(), mod.inc.s()).apply_async()
    assert second.get(timeout=30)["n"] == 13
    assert (tmp_path / "plain-2").exists()
    # An immutable leased step keeps its own payload.
    third = chain(mod.plain_add.si(5, 5), mod.inc.si({"n": 100})).apply_async()
    assert third.get(timeout=30) == {"n": 101}


def test_group_chord_and_callbacks(pg, broker, client_app, workers, tmp_path):
    from celery import chord, group

    mod = client_app(pg, broker, module=NATIVE)
    workers(pg, broker, module=NATIVE)
    # One submit for the group's leased members; GroupResult.get() in the group's order.
    grouped = group(mod.inc.s({"n": i}) for i in range(3)).apply_async()
    assert [r["n"] for r in grouped.get(timeout=30)] == [1, 2, 3]
    # A mixed group: the plain member is Celery's, the leased ones ours.
    mixed = group(mod.inc.s({"n": 10}), mod.plain_bump.s({"n": 5, "dir": str(tmp_path)}), mod.inc.s({"n": 20})).apply_async()
    assert mixed.results[0].get(timeout=30) == {"n": 11} and mixed.results[2].get(timeout=30) == {"n": 21}
    wait_for(lambda: (tmp_path / "plain-5").exists(), timeout=30, what="the plain member")

    body = chord([mod.inc.s({"n": i}) for i in range(4)], mod.total.s()).apply_async()
    assert body.get(timeout=30) == 1 + 2 + 3 + 4
    assert _count(pg, jobs.c.kind == "total") == 1  # the body was created once

    linked = mod.inc.apply_async(({"n": 1},), link=mod.inc.s(), priority=7)
    wait_for(lambda: _count(pg, jobs.c.parent_id == linked.id, jobs.c.status == "succeeded") == 1, timeout=30, what="link")
    assert mod.leases.get(linked.id).result == {"n": 2}
    engine = sa.create_engine(pg)
    with engine.connect() as conn:
        canvas = conn.execute(sa.select(jobs.c.canvas).where(jobs.c.id == linked.id)).scalar_one()
        child = conn.execute(sa.select(jobs.c.result).where(jobs.c.parent_id == linked.id)).scalar_one()
    engine.dispose()
    assert canvas["priority"] == 7 and child == {"n": 3}

    failing = mod.inc.apply_async(({"n": 1, "fail_at": 1},), link_error=[mod.noted_error.s(), mod.plain_errback.s(str(tmp_path))])
    wait_for(lambda: (tmp_path / f"errback-{failing.id}").exists(), timeout=30, what="the plain errback")
    noted = wait_for(
        lambda: _count(pg, jobs.c.kind == "noted_error", jobs.c.status == "succeeded") == 1, timeout=30, what="errback job"
    )
    assert noted
    assert failing.state == "FAILURE"


def test_unsupported_canvas_is_refused_before_anything_is_stored(pg, broker, client_app):
    import pytest
    from celery import chain

    mod = client_app(pg, broker, module=NATIVE)
    with pytest.raises(TypeError, match=r"\.si\(payload\)"):
        mod.inc.s({"n": 1}, {"n": 2})
    with pytest.raises(TypeError, match="submit_many"):
        mod.inc.map([{"n": 1}])
    with pytest.raises(TypeError, match="lease_seconds"):
        mod.inc.apply_async(({"n": 1},), time_limit=5)
    with pytest.raises(TypeError, match="queue="):
        mod.inc.signature(({"n": 1},), routing_key="x")
    # A mutable step that also has its own payload would get two: refused at apply.
    with pytest.raises(TypeError, match=r"inc\.s\(\)"):
        chain(mod.inc.s({"n": 1}), mod.inc.s({"n": 5})).apply_async()
    assert _count(pg) == 0


# --- revoke ----------------------------------------------------------------------------------


def test_revoke_with_and_without_terminate_cancels_the_job_durably(pg, broker, client_app, workers, tmp_path):
    import subprocess

    from tests.conftest import CELERY, ROOT, _env

    mod = client_app(pg, broker, module=NATIVE)
    workers(pg, broker, module=NATIVE)

    def cancelled(job_id):
        return wait_for(lambda: mod.leases.get(job_id).status is Status.CANCELLED, timeout=30, what=f"{job_id} to be cancelled")

    # Pending (delayed: its wakeup is not even sent yet), revoked from Celery's CLI.
    later = mod.inc.submit({"n": 1}, run_after=600)
    # (The CLI waits --timeout for replies; the cancelled row below is what counts.)
    cli = [CELERY, "-A", NATIVE, "control", "revoke", "--timeout", "2", later.id]
    subprocess.run(cli, env=_env(pg, broker), cwd=ROOT, capture_output=True, timeout=60)
    cancelled(later.id)

    # Running, cooperative: revoke without terminate stops it at its next stop point.
    running = mod.inc.submit({"n": 1, "slow_at": 1, "dir": str(tmp_path)})
    wait_for(lambda: (tmp_path / "inc-1-1").exists(), timeout=30, what="the running job to start")
    mod.app.control.revoke(running.id)
    cancelled(running.id)

    # Running, not cooperative: terminate=True kills the process running it.
    stuck = mod.sleepy.submit({"sleep": 60, "marker_dir": str(tmp_path)})
    wait_for(lambda: (tmp_path / f"sleepy-{stuck.id}-1").exists(), timeout=30, what="the sleepy job to start")
    mod.app.control.revoke(stuck.id, terminate=True)
    cancelled(stuck.id)

    # A later wakeup for a revoked job is discarded and changes nothing; the worker goes on.
    mod.app.send_task(stuck.task, task_id=stuck.id)
    ok = mod.echo.submit({"value": 1})
    assert mod.leases.wait(ok.id, 30).status is Status.SUCCEEDED
    for job in (later, running, stuck):
        assert mod.leases.get(job.id).status is Status.CANCELLED
    assert _effects(pg) == []  # neither revoked handler committed anything
    assert mod.leases.get(running.id).attempt == 1 and mod.leases.get(later.id).attempt == 0


def test_errbacks_of_a_revoked_running_job_run_on_the_worker(pg, broker, client_app, workers, tmp_path):
    mod = client_app(pg, broker, module=NATIVE)
    workers(pg, broker, module=NATIVE)
    errbacks = [mod.noted_error.s(), mod.plain_errback.s(str(tmp_path))]
    running = mod.inc.apply_async(({"n": 1, "slow_at": 1, "dir": str(tmp_path)},), link_error=errbacks)
    wait_for(lambda: (tmp_path / "inc-1-1").exists(), timeout=30, what="the running job to start")
    # The worker's revoke command cancels the row; the cancel fires the errbacks.
    mod.app.control.revoke(running.id)
    wait_for(lambda: (tmp_path / f"errback-{running.id}").exists(), timeout=30, what="the plain errback")

    def noted():
        done = [j for j in mod.leases.store.list_jobs(kind="noted_error") if j.status is Status.SUCCEEDED]
        return done or None

    (errback,) = wait_for(noted, timeout=30, what="the leased errback to run")
    assert errback.result == {"failed": running.id, "error": "cancelled"} and errback.parent_id == running.id
    assert mod.leases.get(running.id).status is Status.CANCELLED
    assert _effects(pg) == []


# --- events (what Flower reads) ---------------------------------------------------------------


def test_event_receiver_sees_revoked_jobs_retries_and_payloads(pg, broker, client_app, tmp_path):
    import threading

    from tests.conftest import Worker

    mod = client_app(pg, broker, module=NATIVE)
    worker = Worker("ev", pg, broker, tmp_path, module=NATIVE)
    worker.args.append("-E")  # task events from the command line, not from app.conf
    captured: list[dict] = []
    conn = mod.app.connection_for_read()
    receiver = mod.app.events.Receiver(conn, handlers={"*": captured.append})
    thread = threading.Thread(target=lambda: receiver.capture(limit=None, timeout=None, wakeup=False), daemon=True)
    thread.start()
    try:
        worker.start()

        def events_of(job_id: str, kind: str | None = None) -> list[dict]:
            return [e for e in list(captured) if e.get("uuid") == job_id and (kind is None or e["type"] == kind)]

        # The receiver listens once it sees a job's events (a job submitted before its queue
        # was bound would be missed: submit another each round until one is seen).
        warm: list[str] = []

        def listening():
            if any(events_of(job_id, "task-succeeded") for job_id in warm):
                return True
            warm.append(mod.echo.submit({"value": 0}).id)
            return False

        wait_for(listening, timeout=60, interval=1.0, what="the receiver to get events")

        # A running job cancelled: task-revoked, and no task-succeeded after it.
        running = mod.inc.submit({"n": 1, "slow_at": 1, "dir": str(tmp_path)})
        wait_for(lambda: (tmp_path / "inc-1-1").exists(), timeout=30, what="the job to start")
        mod.leases.cancel(running.id)
        wait_for(lambda: events_of(running.id, "task-revoked"), timeout=30, what="task-revoked for the running job")

        # A pending job cancelled, then its wakeup delivered: task-revoked too.
        pending = mod.echo.submit({"value": 1}, run_after=600)
        mod.leases.cancel(pending.id)
        mod.app.send_task(pending.task, task_id=pending.id)
        wait_for(lambda: events_of(pending.id, "task-revoked"), timeout=30, what="task-revoked for the pending job")

        # A retried job: its second attempt's task-started carries retries=1, the payload
        # and the attempt.
        flaky = mod.flaky.submit({"ok_at": 2})

        def second_attempt():
            mod.leases.sweep()
            return [e for e in events_of(flaky.id, "task-started") if e.get("retries") == 1]

        started = wait_for(second_attempt, timeout=60, interval=0.3, what="the second attempt's task-started")
        assert "'ok_at': 2" in started[0]["args"] and "'attempt': 2" in started[0]["kwargs"]
        wait_for(lambda: events_of(flaky.id, "task-succeeded"), timeout=30, what="the retried job to succeed")
        assert not events_of(running.id, "task-succeeded") and not events_of(pending.id, "task-succeeded")
        assert mod.leases.get(running.id).status is Status.CANCELLED
    finally:
        receiver.should_stop = True
        worker.kill()
        thread.join(timeout=10)
        conn.release()


def test_an_apps_own_result_backend_answers_for_leased_jobs(pg, broker, client_app, workers):
    """A shop keeps Redis as its result backend: plain tasks store there, leased jobs in
    their rows, and Celery's generic result API reads both."""
    from celery import chord, group
    from celery.result import AsyncResult

    own = {"result_backend": broker.rsplit("/", 1)[0] + "/1"}
    mod = client_app(pg, broker, module="tests.apps.app_native", conf=own)
    workers(pg, broker, module="tests.apps.app_native", conf=own)
    job = mod.inc.submit({"n": 1})
    assert mod.app.AsyncResult(job.id).get(timeout=30) == {"n": 2}
    assert AsyncResult(job.id, app=mod.app).state == "SUCCESS"
    assert mod.app.AsyncResult(job.id).result == {"n": 2}
    # Plain members are joined natively through Redis, the leased one through its row.
    members = group(mod.plain_add.s(1, 2), mod.plain_add.s(3, 4), mod.inc.s({"n": 10}))
    result = members.apply_async()
    assert result.get(timeout=30) == [3, 7, {"n": 11}]
    assert result.join_native(timeout=5) == [3, 7, {"n": 11}]
    assert mod.app.AsyncResult(str(uuid.uuid4())).state == "PENDING"  # an unknown id stays PENDING
    # A chord with a leased header counts down in celery-lease's row, not in Redis.
    counted = chord([mod.inc.s({"n": 1}), mod.inc.s({"n": 2})], mod.total.s()).apply_async()
    assert counted.get(timeout=30) == 5
