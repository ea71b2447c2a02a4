"""The worker as a Celery shop converting a project meets it (issue 20), on real workers:
what the logs say, and how fast a job whose pool process the OOM killer took is freed."""

from __future__ import annotations

import logging
import re
import uuid

from celery_lease import Status
from tests.conftest import wait_for

FAST = {"lease_sweep_interval": 0.5, "lease_reap_interval": 1.0, "lease_sweep_stale_seconds": 2.0}


def test_logs_say_what_matters_and_nothing_more(pg, broker, client_app, workers, beats, caplog):
    mod = client_app(pg, broker, conf=FAST)
    worker = workers(pg, broker, conf=FAST)
    beats(pg, broker, conf=FAST)
    refused = mod.flaky.submit({"failure": "bad input"})
    # A retry is delivered by the sweeper: maintenance ticks ran while the worker logged.
    retried = mod.flaky.submit({"ok_at": 2})
    assert mod.leases.wait(retried.id, timeout=60).status is Status.SUCCEEDED
    assert mod.leases.wait(refused.id, timeout=30).error == "bad input"
    # The same Celery task id applied twice is one job, and no lost reply is reported.
    task_id = str(uuid.uuid4())
    with caplog.at_level(logging.DEBUG, logger="celery_lease"):
        first = mod.echo.apply_async(({"value": 1},), task_id=task_id)
        second = mod.echo.apply_async(({"value": 1},), task_id=task_id)
    assert first.id == second.id == task_id
    assert "lost reply" not in caplog.text
    mod.leases.wait(task_id, timeout=30)

    wait_for(lambda: f"[{refused.id}] raised" in worker.log(), what="the refused job's line")
    log = worker.log()
    # The deliberate Failure: Celery's INFO line for an expected outcome, no traceback.
    lines = [line for line in log.splitlines() if refused.id in line]
    assert any(re.search(r"INFO/.*raised expected: JobRefused\('bad input'\)", line) for line in lines), lines
    assert not any("ERROR/" in line for line in lines), lines
    assert "Traceback" not in log.split(refused.id, 1)[1].split("\n[", 1)[0]
    # Maintenance ticks are DEBUG: nothing about them at INFO.
    assert "maintenance tick" not in log and "swept" not in log


def test_a_pool_process_killed_mid_job_releases_its_lease_at_once(pg, broker, client_app, workers, marker_dir):
    """The OOM killer takes a prefork child: Celery reports WorkerLostError at once, and the
    job is requeued (then, on its last attempt, expired) at once, not after its 60 s lease.
    No beat runs: nothing else could reap it in time."""
    import os
    import signal
    import time

    long_lease = {"CL_TEST_LEASE": "60"}
    mod = client_app(pg, broker, extra_env=long_lease)
    worker = workers(pg, broker, extra_env=long_lease, concurrency=2)
    job = mod.sleepy.submit({"sleep": 600, "marker_dir": str(marker_dir)})

    def kill_attempt(n: int) -> float:
        marker = marker_dir / f"sleepy-{job.id}-{n}"
        wait_for(marker.exists, timeout=30, what=f"attempt {n} to start")
        running = wait_for(lambda: (j := mod.leases.get(job.id)).status is Status.RUNNING and j.attempt == n and j, timeout=30)
        pid = int(running.lease_owner.split("/")[1])
        assert pid in worker.children() and pid == int(marker.read_text().split()[0])
        os.kill(pid, signal.SIGKILL)
        return time.monotonic()

    killed = kill_attempt(1)
    second = wait_for(lambda: marker_dir.joinpath(f"sleepy-{job.id}-2").exists(), timeout=20, what="attempt 2 to start")
    assert second and time.monotonic() - killed < 20  # far less than the 60 s lease
    assert mod.leases.get(job.id).lease_losses == 1
    killed = kill_attempt(2)
    ended = wait_for(lambda: (j := mod.leases.get(job.id)).terminal and j, timeout=20, what="the last attempt to expire")
    assert ended.status is Status.EXPIRED and ended.error == "lease expired" and ended.lease_losses == 2
    assert "its worker process" in worker.log() and "lease released" in worker.log()
