"""The Django project (tests/apps/djangoproj) under a real `celery worker`: django.tasks
through LeaseTaskBackend, leased jobs from an autodiscovered reusable app, and the
`celery lease` CLI seeing kinds that only autodiscovered modules declare."""

from __future__ import annotations

import json
import re
import subprocess

from tests.conftest import CELERY, ROOT
from tests.harness.djangoproj import PROJECT, SETTINGS, django_db_fixture, django_env, drive  # noqa: F401  (fixture)


def lease_cli(db: str, broker: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [CELERY, "-A", PROJECT, "lease", *args], cwd=ROOT, env=django_env(db, broker), capture_output=True, text=True, timeout=120
    )


def test_django_tasks_run_as_leased_jobs_in_a_celery_worker(django_db, broker, workers, beats):
    workers(django_db, broker, module=PROJECT, extra_env=SETTINGS, concurrency=2)
    beats(django_db, broker, module=PROJECT, extra_env=SETTINGS)  # the sweeper delivers retries
    seen = drive("tasks", django_db, broker)
    # Enqueued inside a rolled-back atomic block: no job at all.
    assert seen["rolled_back_result"] == "does not exist"
    assert seen["enqueued_status"] == "READY"
    assert seen["add"] == {"status": "SUCCESSFUL", "value": 5, "attempts": 1, "errors": [], "job_status": "succeeded"}
    # An exception is retried (MAX_ATTEMPTS 2): the second attempt's context says so.
    assert seen["retried"]["status"] == "SUCCESSFUL" and seen["retried"]["value"] == {"attempt": 2}
    assert seen["retried"]["attempts"] == 2
    # Spent attempts: FAILED with the stored error, never the exception's text.
    assert seen["fails"]["status"] == "FAILED" and seen["fails"]["job_status"] == "failed"
    (error,) = seen["fails"]["errors"]
    assert re.fullmatch(r"internal error: RuntimeError \(ref [0-9a-f]{8}\)", error), error
    assert "hunter2" not in json.dumps(seen)


def test_cli_sees_kinds_of_autodiscovered_task_modules(django_db, broker):
    paused = lease_cli(django_db, broker, "pause", "shop_fulfil", "--json")
    assert paused.returncode == 0, paused.stderr
    assert json.loads(paused.stdout)["paused"] is True
    limits = lease_cli(django_db, broker, "limits", "--json")
    assert limits.returncode == 0, limits.stderr
    rows = {row["kind"]: row for row in json.loads(limits.stdout)["kinds"]}
    # Kinds that only shop/tasks.py declares: one paused, one with a fleet-wide limit.
    assert rows["shop_fulfil"]["paused"] is True
    assert rows["shop_slow"]["concurrency"] == 2 and rows["shop_slow"]["paused"] is False
    resumed = lease_cli(django_db, broker, "resume", "shop_fulfil")
    assert resumed.returncode == 0 and "resumed shop_fulfil" in resumed.stdout
    unknown = lease_cli(django_db, broker, "pause", "no_such_kind")
    assert unknown.returncode == 2 and "no job handler for kind 'no_such_kind'" in unknown.stderr
    assert "shop_fulfil" in unknown.stderr  # the registered kinds are listed
