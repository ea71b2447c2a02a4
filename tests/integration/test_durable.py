"""Durable execution against real PostgreSQL (and SQLite where it applies), Redis and
`celery worker` / `celery beat` processes: checkpoints, progress, typed jobs,
exactly-once effects, runs and chaining, idempotency, beat slot keys, retention."""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone

import pytest
import redis
import sqlalchemy as sa

from celery_lease import (
    CheckpointTooLarge,
    ConfigurationError,
    InvalidPayload,
    JobContext,
    LeaseError,
    Status,
    UnknownKind,
)
from celery_lease.beat.maintenance import MAX_CHUNKS
from celery_lease.db.schema import events, jobs, runs
from celery_lease.worker.context import PROGRESS_MIN_INTERVAL
from tests.conftest import ROOT, _env, attempt_for, wait_for

MODULE = "tests.apps.app_durable"


@pytest.fixture(params=["postgresql", "sqlite"])
def db(request):
    """Each test using it runs once on PostgreSQL and once on SQLite."""
    return request.getfixturevalue("pg" if request.param == "postgresql" else "sqlite_url")


@pytest.fixture
def durable_app(client_app):
    """tests.apps.app_durable in this process; tests.apps.app is re-imported with it, so its app
    and leases pick up this test's database, broker and settings."""

    def make(db_url: str, broker_url: str, conf: dict | None = None, extra_env: dict | None = None):
        sys.modules.pop("tests.apps.app", None)
        return client_app(db_url, broker_url, conf=conf, extra_env=extra_env, module=MODULE)

    return make


@pytest.fixture
def sql():
    engines: dict[str, sa.Engine] = {}

    def connect(db_url: str) -> sa.Engine:
        return engines.setdefault(db_url, sa.create_engine(db_url))

    yield connect
    for engine in engines.values():
        engine.dispose()


def stored(sql, db_url: str, job_id: str, column: str):
    """A raw column of a job row (some, like checkpoint, are not on Job)."""
    with sql(db_url).connect() as conn:
        return conn.execute(sa.select(jobs.c[column]).where(jobs.c.id == job_id)).scalar_one()


def effect_rows(sql, db_url: str, job_id: str | None = None) -> list[tuple]:
    from tests.apps.app import effects

    stmt = sa.select(effects.c.job_id, effects.c.attempt, effects.c.note).order_by(effects.c.id)
    if job_id is not None:
        stmt = stmt.where(effects.c.job_id == job_id)
    with sql(db_url).connect() as conn:
        return [tuple(r) for r in conn.execute(stmt)]


def count_jobs(sql, db_url: str, *where) -> int:
    with sql(db_url).connect() as conn:
        return conn.execute(sa.select(sa.func.count()).select_from(jobs).where(*where)).scalar()


def finish(mod, job_id: str, timeout: float = 60.0):
    """Wait for a terminal job, sweeping as beat would so retries are delivered."""

    def done():
        mod.leases.sweep()
        job = mod.leases.get(job_id)
        return job if job.terminal else None

    return wait_for(done, timeout=timeout, interval=0.2, what=f"job {job_id} to finish")


def reap_one(mod, timeout: float = 30.0) -> None:
    wait_for(lambda: mod.leases.reap()["requeued"] == 1, timeout=timeout, interval=0.5, what="the reaper to requeue the job")


# --- 1. checkpoints -------------------------------------------------------------------


def test_checkpoint_save_is_capped_fenced_and_configurable(db, broker, durable_app, make_job, sql):
    mod = durable_app(db, broker, conf={"lease_max_checkpoint_bytes": 200})
    assert mod.leases.settings.max_checkpoint_bytes == 200
    job_id = make_job(db, kind="steps", task="tests.apps.app.steps", status="running", lease_generation=5, checkpoint={"v": 1})

    def context(generation: int) -> JobContext:
        return mod.leases.worker.context(attempt_for(job_id, generation=generation, checkpoint={"v": 1}))

    live = context(5)
    assert live.checkpoint == {"v": 1}
    assert live.save_checkpoint({"v": 2}) is True
    assert stored(sql, db, job_id, "checkpoint") == {"v": 2}
    # Over the configured cap: refused with a clear error, nothing written.
    with pytest.raises(CheckpointTooLarge, match="over the cap of 200"):
        live.save_checkpoint({"blob": "x" * 300})
    assert stored(sql, db, job_id, "checkpoint") == {"v": 2}
    assert live.checkpoint == {"v": 2}
    assert live.save_checkpoint({"blob": "x" * 150}) is True  # under the cap

    # A stale attempt (older generation) writes nothing and learns it lost the lease.
    stale = context(4)
    assert stale.save_checkpoint({"v": "stale"}) is False
    assert stale.cancelled
    stale.publish({"p": "stale"})
    assert stored(sql, db, job_id, "checkpoint") == {"blob": "x" * 150}
    assert stored(sql, db, job_id, "progress") is None

    # Once the job is cancelled, the live attempt is fenced out too, and cancel kept
    # the checkpoint (status updates never write it).
    assert mod.leases.cancel(job_id)
    assert live.save_checkpoint({"v": "after cancel"}) is False
    assert stored(sql, db, job_id, "checkpoint") == {"blob": "x" * 150}

    # The load side is capped too.
    with pytest.raises(CheckpointTooLarge):
        mod.leases.worker.context(attempt_for(job_id, generation=7, attempt=2, checkpoint={"blob": "x" * 300}))


def test_retry_keeps_the_checkpoint_and_the_next_attempt_resumes_from_it(db, broker, durable_app, workers, sql):
    mod = durable_app(db, broker)
    workers(db, broker, module=MODULE)
    job = mod.ckpt.submit({"mode": "retry"})
    # Attempt 1 saved a checkpoint and raised: the retry is pending until swept.
    wait_for(
        lambda: (j := mod.leases.get(job.id)).status is Status.PENDING and j.attempt == 1,
        timeout=30,
        what="the first attempt to be retried",
    )
    assert stored(sql, db, job.id, "checkpoint") == {"from": 1}
    done = finish(mod, job.id)
    assert done.status is Status.SUCCEEDED
    assert done.result == {"seen": {"from": 1}, "attempt": 2}
    # Cleared in the success transaction.
    assert stored(sql, db, job.id, "checkpoint") is None


def test_failure_keeps_the_checkpoint_and_a_refused_save_writes_nothing(db, broker, durable_app, workers, sql):
    mod = durable_app(db, broker)
    workers(db, broker, module=MODULE, conf={"lease_max_checkpoint_bytes": 1000})
    failed = mod.ckpt.submit({"mode": "fail"})
    capped = mod.ckpt.submit({"mode": "cap", "big": 2000})
    done = mod.leases.wait(failed.id, 30)
    assert done.status is Status.FAILED and done.error == "stopped after a checkpoint"
    assert stored(sql, db, failed.id, "checkpoint") == {"kept": True}
    done = mod.leases.wait(capped.id, 30)
    assert done.status is Status.FAILED
    assert done.error.startswith("refused: checkpoint is") and "over the cap of 1000" in done.error
    assert stored(sql, db, capped.id, "checkpoint") == {"a": 1}


def test_resume_from_the_checkpoint_after_the_worker_is_killed_and_reaped(db, broker, durable_app, workers, marker_dir, sql):
    mod = durable_app(db, broker, extra_env={"CL_TEST_LEASE": "3"})
    w1 = workers(db, broker, name="w1", module=MODULE)
    # With an effect, success goes through the transactional completion (the plain one
    # is covered by the retry test): both clear the checkpoint.
    job = mod.steps.submit({"steps": 40, "sleep": 0.1, "marker_dir": str(marker_dir), "effect": True})
    wait_for(lambda: (stored(sql, db, job.id, "checkpoint") or {}).get("i", 0) >= 3, timeout=30, what="a few checkpoints")
    w1.kill()
    saved = stored(sql, db, job.id, "checkpoint")["i"]
    reap_one(mod)
    assert stored(sql, db, job.id, "checkpoint") == {"i": saved}  # the reaper keeps it
    workers(db, broker, name="w2", module=MODULE)
    done = mod.leases.wait(job.id, 60)
    assert done.status is Status.SUCCEEDED and done.attempt == 2
    assert done.result == {"counted": 40, "resumed_from": saved}
    assert (marker_dir / "start-1-0").exists() and (marker_dir / f"start-2-{saved}").exists()
    assert stored(sql, db, job.id, "checkpoint") is None
    assert effect_rows(sql, db, job.id) == [(job.id, 2, "steps")]


def test_oversized_stored_checkpoint_fails_the_attempt_as_internal_error(
    db, broker, durable_app, workers, make_job, marker_dir, sql
):
    mod = durable_app(db, broker)
    w = workers(db, broker, module=MODULE, conf={"lease_max_checkpoint_bytes": 1000})
    # Stored under a larger cap (or by an older version): over this worker's cap.
    job_id = make_job(
        db,
        kind="ckpt",
        task="tests.apps.app_durable.ckpt",
        max_attempts=2,
        payload={"mode": "retry", "dir": str(marker_dir)},
        checkpoint={"blob": "x" * 5000},
    )
    mod.leases.publish_wakeups([{"id": job_id, "task": "tests.apps.app_durable.ckpt", "queue": None}])
    done = finish(mod, job_id)
    assert done.status is Status.FAILED and done.attempt == 2
    assert done.error.startswith("internal error: celery_lease.errors.CheckpointTooLarge (ref ")
    assert not list(marker_dir.iterdir())  # the handler never ran on it
    assert "over the cap of 1000" in w.log() and job_id in w.log()
    assert stored(sql, db, job_id, "checkpoint") == {"blob": "x" * 5000}


# --- 2. progress ----------------------------------------------------------------------


def test_progress_is_visible_while_running_and_the_last_value_lands(db, broker, durable_app, workers):
    mod = durable_app(db, broker)
    workers(db, broker, module=MODULE)
    job = mod.steps.submit({"steps": 12, "sleep": 0.3})
    seen = wait_for(
        lambda: (j := mod.leases.get(job.id)).status is Status.RUNNING and j.progress,
        timeout=30,
        interval=0.05,
        what="progress while running",
    )
    assert seen["of"] == 12 and 1 <= seen["done"] < 12
    done = mod.leases.wait(job.id, 30)
    assert done.status is Status.SUCCEEDED and done.progress == {"done": 12, "of": 12}


def test_a_tight_publish_loop_costs_a_few_writes_and_the_last_value_lands(db, broker, durable_app, workers):
    mod = durable_app(db, broker)
    workers(db, broker, module=MODULE)
    n = 20_000
    job = mod.chatty.submit({"n": n})
    done = mod.leases.wait(job.id, 60)
    assert done.status is Status.SUCCEEDED
    writes, elapsed = done.result["writes"], done.result["elapsed"]
    # At most one write per PROGRESS_MIN_INTERVAL (plus the first), never one per call.
    assert 1 <= writes <= 2 + elapsed / PROGRESS_MIN_INTERVAL, done.result
    assert writes * 100 < n, done.result
    # The last value was still unwritten when the handler returned: completion wrote it.
    assert done.result["unwritten_at_return"] is True
    assert done.progress == {"i": n}
    print(f"\n{n} publishes in {elapsed:.3f}s -> {writes} progress writes")


def test_progress_is_emitted_as_a_celery_event(pg, broker, durable_app, workers):
    mod = durable_app(pg, broker)
    workers(pg, broker, module=MODULE, conf={"worker_send_task_events": True})
    got: list[dict] = []
    receivers = []

    def capture():
        with mod.app.connection_for_read() as conn:
            receiver = mod.app.events.Receiver(conn, handlers={"task-progress": got.append})
            receivers.append(receiver)
            receiver.capture(limit=None, timeout=None, wakeup=False)

    thread = threading.Thread(target=capture, daemon=True)
    thread.start()
    client = redis.Redis.from_url(broker)
    wait_for(lambda: client.pubsub_numpat() or client.pubsub_channels(), timeout=20, what="the event receiver to subscribe")
    try:
        job = mod.steps.submit({"steps": 8, "sleep": 0.3})
        assert mod.leases.wait(job.id, 30).status is Status.SUCCEEDED
        mine = wait_for(lambda: [e for e in got if e.get("uuid") == job.id], timeout=20, what="task-progress events")
    finally:
        receivers[0].should_stop = True
        thread.join(10)
    assert all(e["type"] == "task-progress" for e in mine)
    assert {"done", "of"} <= set(mine[-1]["progress"]) and mine[-1]["progress"]["of"] == 8


# --- 3. typed jobs ----------------------------------------------------------------------


def test_typed_payloads_are_delivered_typed_and_results_serialized(db, broker, durable_app, workers):
    mod = durable_app(db, broker)
    workers(db, broker, module=MODULE)
    # The handlers assert isinstance(payload, ...): an untyped delivery fails the job.
    dc_obj = mod.typed_dc.submit(mod.Point(x=2, y=3))
    dc_dict = mod.typed_dc.submit({"x": 5, "y": 1})
    pd_obj = mod.typed_pd.submit(mod.Order(sku="abc", quantity=2))
    pd_dict = mod.typed_pd.submit({"sku": "xyz", "quantity": "7"})  # pydantic coerces
    assert dc_obj.payload == {"x": 2, "y": 3} and pd_dict.payload == {"sku": "xyz", "quantity": 7}
    results = {j.id: mod.leases.wait(j.id, 30) for j in (dc_obj, dc_dict, pd_obj, pd_dict)}
    assert all(j.status is Status.SUCCEEDED for j in results.values()), results
    assert results[dc_obj.id].result == {"x": 4, "y": 6}
    assert results[dc_dict.id].result == {"x": 10, "y": 2}
    assert results[pd_obj.id].result == {"sku": "ABC", "quantity": 3}
    assert results[pd_dict.id].result == {"sku": "XYZ", "quantity": 8}


def test_bad_payloads_raise_at_submit_and_store_nothing(db, broker, durable_app, sql):
    mod = durable_app(db, broker, conf={"lease_max_payload_bytes": 1000})
    run_id = str(uuid.uuid4())
    refused = [
        (mod.typed_dc, {"x": 1}),  # missing field
        (mod.typed_dc, {"x": 1, "y": 2, "z": 3}),  # unknown field
        (mod.typed_dc, [1, 2]),
        (mod.typed_pd, {"sku": "a", "quantity": "many"}),
        (mod.typed_pd, mod.Point(x=1, y=2)),
        (mod.echo, {"when": datetime.now(timezone.utc)}),
        (mod.echo, {"n": float("nan")}),
        (mod.echo, object()),
        (mod.echo, {"blob": "x" * 2000}),  # over lease_max_payload_bytes
    ]
    for task, payload in refused:
        with pytest.raises(InvalidPayload):
            task.submit(payload, run_id=run_id)
    with pytest.raises(InvalidPayload, match="quantity"):
        mod.typed_pd.submit({"sku": "a", "quantity": "many"})
    with pytest.raises(InvalidPayload, match="over the cap of 1000"):
        mod.echo.submit({"blob": "x" * 2000})
    # One bad payload in a batch refuses the whole batch.
    with pytest.raises(InvalidPayload):
        mod.echo.submit_many([{"ok": 1}, {"bad": {1, 2}}])
    with pytest.raises(UnknownKind, match="nope"):
        mod.leases.submit("nope", {})
    assert count_jobs(sql, db) == 0
    with sql(db).connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(runs)).scalar() == 0
    assert redis.Redis.from_url(broker).llen("celery") == 0  # no wakeup either


# --- 4. exactly-once database effects ---------------------------------------------------


@pytest.mark.parametrize("stale_first", [True, False], ids=["stale-finishes-first", "fresh-finishes-first"])
def test_stale_and_fresh_attempts_race_and_one_set_of_effect_rows_lands(
    db, broker, durable_app, workers, marker_dir, sql, stale_first
):
    mod = durable_app(db, broker, extra_env={"CL_TEST_GATED_LEASE": "3"})
    w1 = workers(db, broker, name="w1", concurrency=1, module=MODULE)
    job = mod.gated.submit({"dir": str(marker_dir), "rows": 3})
    wait_for(lambda: (marker_dir / "gated-1").exists(), timeout=30, what="attempt 1 to start")
    assert int(mod.leases.get(job.id).lease_owner.split("/")[1]) in w1.children()
    # Freeze the whole first worker (its heartbeat included) past the lease: a GC or
    # VM pause. Its main process is frozen too, so it cannot take the next wakeup.
    os.killpg(w1.pid, signal.SIGSTOP)
    try:
        reap_one(mod)
        workers(db, broker, name="w2", concurrency=1, module=MODULE)
        wait_for(lambda: (marker_dir / "gated-2").exists(), timeout=30, what="attempt 2 to start")
        lost = f"job {job.id}: lease lost; succeeded outcome discarded"
        if stale_first:
            (marker_dir / "open-1").touch()
            os.killpg(w1.pid, signal.SIGCONT)
            wait_for(lambda: lost in w1.log(), timeout=30, what="the stale attempt to be fenced out")
            assert effect_rows(sql, db, job.id) == []
            (marker_dir / "open-2").touch()
            assert mod.leases.wait(job.id, 30).status is Status.SUCCEEDED
        else:
            (marker_dir / "open-2").touch()
            assert mod.leases.wait(job.id, 30).status is Status.SUCCEEDED
            (marker_dir / "open-1").touch()
            os.killpg(w1.pid, signal.SIGCONT)
            wait_for(lambda: lost in w1.log(), timeout=30, what="the stale attempt to be fenced out")
    finally:
        os.killpg(w1.pid, signal.SIGCONT)
    done = mod.leases.get(job.id)
    assert done.status is Status.SUCCEEDED and done.attempt == 2 and done.result == {"attempt": 2}
    assert effect_rows(sql, db, job.id) == [(job.id, 2, f"row {i}") for i in range(3)]


# --- 5. runs and chaining ---------------------------------------------------------------


def test_children_are_created_with_the_parents_success_in_its_run(db, broker, durable_app, workers, sql):
    mod = durable_app(db, broker)
    workers(db, broker, module=MODULE)
    run_id = str(uuid.uuid4())
    parent = mod.parent.submit({"children": [1, 2, 3]}, run_id=run_id)
    assert mod.leases.wait(parent.id, 30).status is Status.SUCCEEDED
    children = [j for j in mod.leases.store.list_jobs(run_id=run_id, limit=10) if j.id != parent.id]
    assert len(children) == 3
    assert {c.parent_id for c in children} == {parent.id} and {c.run_id for c in children} == {run_id}
    done = [mod.leases.wait(c.id, 30) for c in children]
    assert sorted(j.result["echo"] for j in done) == [1, 2, 3]
    dispatched = [e for e in mod.leases.run_events(run_id) if e["event"] == "dispatched"]
    assert sum(e["detail"] == f"child of {parent.id}" for e in dispatched) == 3


def test_no_child_and_no_effect_without_the_parents_success(db, broker, durable_app, workers, sql):
    mod = durable_app(db, broker)
    workers(db, broker, module=MODULE)
    failed = mod.parent.submit({"children": [1, 2], "fail_after_submit": True})
    broken = mod.parent_effect_fails.submit({"children": [3, 4]})
    done = mod.leases.wait(failed.id, 30)
    assert done.status is Status.FAILED and done.error == "parent failed after staging children"
    # An effect raising inside the success transaction rolls back the success, the
    # effects before it and the children: the job is an internal error, not a success.
    done = finish(mod, broken.id)
    assert done.status is Status.FAILED and done.error.startswith("internal error: RuntimeError (ref ") and done.result is None
    assert count_jobs(sql, db) == 2  # the two parents, no child
    assert effect_rows(sql, db) == []


def test_a_child_with_an_existing_idempotency_key_is_that_job(db, broker, durable_app, workers, sql):
    mod = durable_app(db, broker)
    first = mod.echo.submit({"value": "first"}, idempotency_key="child-1")
    workers(db, broker, module=MODULE)
    parent = mod.parent_keyed.submit({"keys": ["child-1", "child-2"]})
    assert mod.leases.wait(parent.id, 30).status is Status.SUCCEEDED
    assert count_jobs(sql, db, jobs.c.idempotency_key == "child-1") == 1
    assert mod.leases.get(first.id).parent_id is None  # untouched by the parent
    (child,) = [j for j in mod.leases.store.list_jobs(kind="echo", limit=10) if j.idempotency_key == "child-2"]
    assert child.parent_id == parent.id
    assert mod.leases.wait(child.id, 30).result["echo"] == "child-2"


def test_cancel_run_cancels_its_jobs_refuses_submits_and_discards_late_results(db, broker, durable_app, workers, marker_dir, sql):
    mod = durable_app(db, broker)
    w = workers(db, broker, concurrency=1, module=MODULE)
    run_id = str(uuid.uuid4())
    running = mod.gated.submit({"dir": str(marker_dir)}, run_id=run_id)
    waiting = mod.echo.submit({"value": "later"}, run_id=run_id, run_after=3600)
    outside = mod.echo.submit({"value": "not in the run"})
    wait_for(lambda: (marker_dir / "gated-1").exists(), timeout=30, what="the gated job to start")
    assert mod.leases.cancel_run(run_id) == 2
    assert mod.leases.get(running.id).status is Status.CANCELLED
    assert mod.leases.get(waiting.id).status is Status.CANCELLED
    with pytest.raises(LeaseError, match="cancelled"):
        mod.echo.submit({"value": "too late"}, run_id=run_id)
    assert count_jobs(sql, db, jobs.c.run_id == run_id) == 2
    # The handler, which never checks for cancel, finishes anyway: its result and its
    # effect rows are discarded and the job stays cancelled.
    (marker_dir / "open").touch()
    wait_for(
        lambda: f"job {running.id}: lease lost; succeeded outcome discarded" in w.log(),
        timeout=30,
        what="the late result to be discarded",
    )
    late = mod.leases.get(running.id)
    assert late.status is Status.CANCELLED and late.result is None
    assert effect_rows(sql, db) == []
    assert mod.leases.wait(outside.id, 30).status is Status.SUCCEEDED
    assert mod.leases.cancel_run(run_id) == 0
    log = mod.leases.run_events(run_id)
    assert [e["event"] for e in log if e["job_id"] == running.id] == ["dispatched", "claimed", "cancelled"]
    assert [e["event"] for e in log if e["job_id"] == waiting.id] == ["dispatched", "cancelled"]


def test_run_event_log_records_each_jobs_life_in_order(db, broker, durable_app, workers, marker_dir):
    mod = durable_app(db, broker, extra_env={"CL_TEST_GATED_LEASE": "3"})
    w1 = workers(db, broker, name="w1", module=MODULE)
    run_id = str(uuid.uuid4())
    retried = mod.flaky.submit({"ok_at": 2}, run_id=run_id)
    failed = mod.flaky.submit({"failure": "no source table"}, run_id=run_id)
    assert finish(mod, retried.id).status is Status.SUCCEEDED
    assert finish(mod, failed.id).status is Status.FAILED
    cancelled = mod.echo.submit({"value": 1}, run_id=run_id, run_after=3600)
    assert mod.leases.cancel(cancelled.id)
    reaped = mod.gated.submit({"dir": str(marker_dir)}, run_id=run_id)
    wait_for(lambda: (marker_dir / "gated-1").exists(), timeout=30, what="the gated job to start")
    w1.kill()
    (marker_dir / "open-2").touch()
    reap_one(mod)
    workers(db, broker, name="w2", module=MODULE)
    assert mod.leases.wait(reaped.id, 30).status is Status.SUCCEEDED

    log = mod.leases.run_events(run_id)
    ids = [e["id"] for e in log]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)

    def life(job_id):
        return [(e["event"], e["attempt"]) for e in log if e["job_id"] == job_id]

    assert life(retried.id) == [("dispatched", 0), ("claimed", 1), ("retried", 1), ("claimed", 2), ("succeeded", 2)]
    assert life(failed.id) == [("dispatched", 0), ("claimed", 1), ("failed", 1)]
    assert life(cancelled.id) == [("dispatched", 0), ("cancelled", 0)]
    assert life(reaped.id) == [("dispatched", 0), ("claimed", 1), ("reaped", 1), ("claimed", 2), ("succeeded", 2)]
    assert next(e["detail"] for e in log if e["job_id"] == failed.id and e["event"] == "failed") == "no source table"


# --- 6. idempotency under concurrent submits ---------------------------------------------


def test_concurrent_submits_of_one_key_make_one_job(db, broker, durable_app, sql):
    mod = durable_app(db, broker)
    n = 12
    barrier = threading.Barrier(n)

    def submit(i: int) -> str:
        barrier.wait()
        return mod.echo.submit({"value": i}, idempotency_key="one-key").id

    with ThreadPoolExecutor(n) as pool:
        ids = list(pool.map(submit, range(n)))
    assert len(set(ids)) == 1
    assert count_jobs(sql, db) == 1
    assert redis.Redis.from_url(broker).llen("celery") == 1  # one wakeup, from the insert


def test_concurrent_submits_from_processes_make_one_job(pg, broker, durable_app, tmp_path, sql):
    durable_app(pg, broker)
    n = 6
    script = (
        "import os, sys, time\n"
        "import tests.apps.app_durable as m\n"
        "d = sys.argv[1]\n"
        "open(os.path.join(d, f'ready-{os.getpid()}'), 'w').close()\n"
        "while not os.path.exists(os.path.join(d, 'go')): time.sleep(0.005)\n"
        "print(m.echo.submit({'value': os.getpid()}, idempotency_key='proc-key').id)\n"
    )
    env = _env(pg, broker)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(tmp_path)],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(n)
    ]
    try:
        wait_for(lambda: len(list(tmp_path.glob("ready-*"))) == n, timeout=60, what="submitters to be ready")
        (tmp_path / "go").touch()
        outputs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), [err for _, err in outputs]
    ids = {out.strip() for out, _ in outputs}
    assert len(ids) == 1
    assert count_jobs(sql, pg) == 1


# --- 7. beat slot keys ----------------------------------------------------------------------


def test_periodic_entries_are_checked_and_slots_are_aligned(pg, broker, durable_app):
    from celery.schedules import crontab

    mod = durable_app(pg, broker)
    entry = mod.app.conf.beat_schedule["durable-tick"]
    assert entry["task"] == "celery_lease.beat_submit" and entry["args"] == ("durable-tick",)
    tick = mod.leases.beat_jobs.entry("durable-tick")
    t = datetime(2026, 11, 30, 12, 0, 4, tzinfo=timezone.utc).timestamp()
    # Every tick within one 2-second slot gets the slot's key, whichever beat fires it.
    assert tick.slot_key(t) == tick.slot_key(t + 1.999) == "beat:durable-tick:2026-11-30T12:00:04+00:00"
    assert tick.slot_key(t + 2) == "beat:durable-tick:2026-11-30T12:00:06+00:00"
    nightly = mod.leases.periodic("nightly", "echo", crontab(minute=0, hour=3), {"value": "n"})
    assert nightly.slot_key(t + 30) == "beat:nightly:2026-11-30T12:00:00+00:00"
    assert mod.leases.periodic("every-minute", mod.echo, timedelta(minutes=1)).payload == {}
    # A kind no handler declares yet is resolved when beat starts (beat/periodic.py).
    assert mod.leases.periodic("later", "nope", 5) is None and "later" in mod.app.conf.beat_schedule
    with pytest.raises(ConfigurationError, match=r"periodic job 'later' \(kind 'nope'\)"):
        mod.leases.beat_jobs.resolve_pending()
    with pytest.raises(UnknownKind):
        mod.leases.periodic("x", object(), 5)
    with pytest.raises(InvalidPayload):
        mod.leases.periodic("x", "echo", 5, {"bad": object()})
    with pytest.raises(TypeError):
        mod.leases.periodic("x", "echo", "every day")
    with pytest.raises(ValueError):
        mod.leases.periodic("x", "echo", 0)
    with pytest.raises(ValueError, match="already"):
        mod.leases.periodic("nightly", "echo", 60)
    assert "x" not in mod.app.conf.beat_schedule


_BEAT_RESULT = re.compile(r"Task celery_lease\.beat_submit\[[^\]]+\] succeeded in [^:]+: (\{.*\})")


def test_two_beats_submit_each_slot_once(db, broker, durable_app, workers, beats, sql):
    mod = durable_app(db, broker)
    w = workers(db, broker, module=MODULE)
    pair = [beats(db, broker, module=MODULE), beats(db, broker, module=MODULE)]

    def sends(beat) -> int:
        return beat.log().count("Sending due task durable-tick (celery_lease.beat_submit)")

    wait_for(lambda: all(sends(b) >= 4 for b in pair), timeout=60, interval=0.5, what="both beats to tick")
    for beat in pair:
        beat.kill()
    total = sum(sends(b) for b in pair)
    wait_for(lambda: len(_BEAT_RESULT.findall(w.log())) == total, timeout=60, interval=0.5, what="every tick to be handled")
    results = [ast.literal_eval(m) for m in _BEAT_RESULT.findall(w.log())]
    by_key: dict[str, set[str]] = {}
    for r in results:
        by_key.setdefault(r["key"], set()).add(r["job"])
    # Every tick of a slot, from either beat, got the same job.
    assert all(len(ids) == 1 for ids in by_key.values()), by_key
    # Both beats fired the same slots, and each slot's duplicate tick stored nothing.
    assert len(by_key) < total and any(sum(r["key"] == key for r in results) == 2 for key in by_key), results
    keyed = mod.leases.store.list_jobs(kind="echo", limit=1000)
    assert sorted(j.idempotency_key for j in keyed) == sorted(by_key)
    for key in by_key:
        slot = datetime.fromisoformat(key.removeprefix("beat:durable-tick:"))
        assert slot.timestamp() % 2 == 0, key
    for job in keyed:
        done = mod.leases.wait(job.id, 30)
        assert done.status is Status.SUCCEEDED and done.attempt == 1 and done.result["echo"] == "tick"
    print(f"\n{total} ticks from two beats -> {len(by_key)} jobs, one per slot")


# --- 8. retention -------------------------------------------------------------------------


def test_prune_deletes_old_terminal_jobs_and_their_events_in_bounded_chunks(db, broker, durable_app, make_job, sql):
    mod = durable_app(db, broker, conf={"lease_batch_size": 2})
    old = datetime.now(timezone.utc) - timedelta(days=10)
    recent = datetime.now(timezone.utc) - timedelta(minutes=1)
    terminal = ["succeeded", "failed", "expired", "cancelled"]
    n_old = 2 * MAX_CHUNKS + 5  # more than one call may delete
    doomed = [make_job(db, status=terminal[i % 4], finished_at=old) for i in range(n_old)]
    kept = [make_job(db, status=s, finished_at=recent) for s in terminal]
    kept += [make_job(db, status="pending", created_at=old), make_job(db, status="running", created_at=old)]
    run_id = str(uuid.uuid4())
    with sql(db).begin() as conn:
        conn.execute(
            events.insert(),
            [{"run_id": run_id, "job_id": j, "event": "succeeded", "attempt": 1, "created_at": old} for j in doomed + kept],
        )

    deleted_per_statement: list[int] = []
    prune_one_batch = mod.leases.store.prune  # one DELETE ... RETURNING per call

    def count(*args, **kwargs):
        deleted_per_statement.append(prune_one_batch(*args, **kwargs))
        return deleted_per_statement[-1]

    mod.leases.store.prune = count
    assert mod.leases.prune(older_than=3600) == 2 * MAX_CHUNKS  # bounded per call
    assert mod.leases.prune(older_than=3600) == 5
    assert mod.leases.prune(older_than=3600) == 0
    assert max(deleted_per_statement) <= 2 and sum(deleted_per_statement) == n_old
    with sql(db).connect() as conn:
        left = {str(r[0]) for r in conn.execute(sa.select(jobs.c.id))}
        logged = {str(r[0]) for r in conn.execute(sa.select(events.c.job_id))}
    assert left == set(kept) and logged == set(kept)


def test_prune_runs_as_a_beat_task_on_a_worker(pg, broker, durable_app, workers, make_job, sql):
    conf = {"lease_retention_seconds": 3600, "lease_prune_interval": 600}
    mod = durable_app(pg, broker, conf=conf)
    entry = mod.app.conf.beat_schedule["celery_lease.prune"]
    assert entry["task"] == "celery_lease.prune" and entry["schedule"] == 600
    old = datetime.now(timezone.utc) - timedelta(hours=2)
    doomed = make_job(pg, status="succeeded", finished_at=old)
    kept = make_job(pg, status="succeeded", finished_at=datetime.now(timezone.utc))
    workers(pg, broker, module=MODULE, conf=conf)
    mod.app.send_task("celery_lease.prune")
    wait_for(lambda: count_jobs(sql, pg, jobs.c.id == doomed) == 0, timeout=30, what="the prune task")
    assert count_jobs(sql, pg, jobs.c.id == kept) == 1
