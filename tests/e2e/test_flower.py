"""Flower, unchanged, shows leased jobs under their job ids: a real Flower process
reading the events of a real worker, asked through Flower's own HTTP API."""

from __future__ import annotations

import os
import re
import signal
import subprocess

import httpx
import pytest

from celery_lease import Status
from tests.conftest import CELERY, ROOT, _env, free_port, wait_for

EVENTS = {"worker_send_task_events": True}


@pytest.fixture
def flower(pg, broker, tmp_path):
    port = free_port()
    log_path = tmp_path / "flower.log"
    env = _env(
        pg,
        broker,
        EVENTS,
        {
            # Flower 2 serves its API only with authentication configured or this set.
            "FLOWER_UNAUTHENTICATED_API": "true",
        },
    )
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [CELERY, "-A", "tests.apps.app", "flower", f"--port={port}", "--address=127.0.0.1", "--persistent=False"],
            env=env,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5)

    def up():
        assert proc.poll() is None, log_path.read_text()[-3000:]
        try:
            return client.get("/api/tasks").status_code == 200
        except httpx.TransportError:
            return False

    wait_for(up, timeout=60, interval=0.2, what="Flower to serve its API")
    yield client
    client.close()
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _flower_task(flower, job_id: str) -> dict | None:
    response = flower.get(f"/api/task/info/{job_id}")
    return response.json() if response.status_code == 200 else None


def _state_in_flower(flower, job_id: str, state: str):
    return wait_for(
        lambda: (t := _flower_task(flower, job_id)) and t.get("state") == state and t,
        timeout=30,
        interval=0.2,
        what=f"Flower to show {job_id} as {state}",
    )


def test_flower_shows_jobs_by_job_id_with_their_state_and_retries(pg, broker, client_app, workers, flower):
    mod = client_app(pg, broker, conf=EVENTS)
    workers(pg, broker, conf=EVENTS)

    job = mod.echo.submit({"value": 5})
    assert mod.leases.wait(job.id, 30).status is Status.SUCCEEDED
    shown = _state_in_flower(flower, job.id, "SUCCESS")
    assert shown["uuid"] == job.id and shown["name"] == "tests.apps.app.echo"
    listed = flower.get("/api/tasks", params={"taskname": "tests.apps.app.echo"}).json()
    assert job.id in listed and listed[job.id]["state"] == "SUCCESS"

    # A job that fails its first attempt: Flower shows RETRY while the job waits for
    # its backoff (only the sweeper delivers the retry, and nobody sweeps yet)...
    flaky = mod.flaky.submit({"ok_at": 2})
    retrying = _state_in_flower(flower, flaky.id, "RETRY")
    assert retrying["name"] == "tests.apps.app.flaky"
    between = mod.leases.get(flaky.id)
    assert between.status is Status.PENDING and between.attempt == 1
    # ...and no trace of the handler's exception text (it may carry a secret), but its
    # type and the reference its traceback is logged under, as the job's run events say.
    assert "password" not in str(retrying)
    assert re.search(r"internal error: ConnectionError \(ref [0-9a-f]{8}\)", retrying["exception"]), retrying

    # ...then SUCCESS under the same id once the sweeper delivers the second attempt.
    def finished():
        mod.leases.sweep()
        current = mod.leases.get(flaky.id)
        return current if current.terminal else None

    done = wait_for(finished, timeout=30, interval=0.2, what="the retry to run")
    assert done.status is Status.SUCCEEDED and done.attempt == 2
    _state_in_flower(flower, flaky.id, "SUCCESS")


def test_flower_shows_a_failed_job_with_its_stored_error_only(pg, broker, client_app, workers, flower):
    mod = client_app(pg, broker, conf=EVENTS)
    workers(pg, broker, conf=EVENTS)
    job = mod.flaky.submit({"failure": "source table is empty"})
    assert mod.leases.wait(job.id, 30).status is Status.FAILED
    shown = _state_in_flower(flower, job.id, "FAILURE")
    assert "source table is empty" in shown["exception"]


def test_flower_shows_revoked_after_progress_and_held_instead_of_started(pg, broker, client_app, workers, flower):
    mod = client_app(pg, broker, conf=EVENTS)
    workers(pg, broker, conf=EVENTS)
    # Cancelled after it published progress: REVOKED, not PROGRESS forever.
    job = mod.steps.submit({"steps": 2000, "sleep": 0.05})
    wait_for(lambda: ((mod.leases.get(job.id).progress or {}).get("done") or 0) >= 3, timeout=30, what="progress")
    _state_in_flower(flower, job.id, "PROGRESS")
    assert mod.leases.cancel(job.id)
    _state_in_flower(flower, job.id, "REVOKED")
    # Held by a pause: HELD, not the STARTED Celery announced for its wakeup; STARTED and
    # then SUCCESS once it runs.
    mod.leases.pause("echo")
    held = mod.echo.submit({"value": 1})
    _state_in_flower(flower, held.id, "HELD")
    assert mod.leases.get(held.id).status is Status.PENDING
    # Cancelled while held (no worker holds it): the canceller announces REVOKED.
    cancelled = mod.echo.submit({"value": 2})
    _state_in_flower(flower, cancelled.id, "HELD")
    assert mod.leases.cancel(cancelled.id)
    _state_in_flower(flower, cancelled.id, "REVOKED")
    mod.leases.resume("echo")
    assert mod.leases.wait(held.id, 30).status is Status.SUCCEEDED
    _state_in_flower(flower, held.id, "SUCCESS")


def test_flower_shows_beats_maintenance_ticks_ended_not_pending(pg, broker, workers, beats, flower):
    # Beat announces each tick it sends (task_send_sent_event, as tasks/app.py sets it);
    # a tick runs on the worker's tick runner, never in the pool, so the runner must say
    # how it ended or Flower keeps it PENDING forever.
    conf = {**EVENTS, "task_send_sent_event": True, "lease_reap_interval": 1, "lease_sweep_interval": 1}
    workers(pg, broker, conf=conf)
    beat = beats(pg, broker, conf=conf)

    def ticks() -> dict:
        listed = {}
        for name in ("celery_lease.reap", "celery_lease.sweep"):
            listed.update(flower.get("/api/tasks", params={"taskname": name}).json())
        return listed

    wait_for(lambda: len(ticks()) >= 4, timeout=60, interval=0.5, what="Flower to list beat's ticks")
    beat.kill()  # no tick sent from here on: each listed one must end
    wait_for(
        lambda: (shown := ticks()) and all(t["state"] == "SUCCESS" for t in shown.values()),
        timeout=30,
        interval=0.5,
        what="every tick Flower lists to be SUCCESS",
    )
