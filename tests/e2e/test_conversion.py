"""Frictions a Celery shop hit converting a project (issue 20), each on real workers:
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
