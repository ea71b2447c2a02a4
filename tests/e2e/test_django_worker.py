"""The Django project (tests/apps/djangoproj) under a real `celery worker`: django.tasks
through LeaseTaskBackend, leased jobs from an autodiscovered reusable app, and the
`celery lease` CLI seeing kinds that only autodiscovered modules declare."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import sqlalchemy as sa

from tests.conftest import CELERY, ROOT, wait_for
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


def _jobs_of(db: str, kind: str) -> list[tuple]:
    engine = sa.create_engine(db)
    try:
        with engine.connect() as conn:
            return list(conn.execute(sa.text("SELECT status, payload FROM celery_lease_jobs WHERE kind = :k"), {"k": kind}))
    finally:
        engine.dispose()


@pytest.mark.parametrize("declared_at", ["import", "finalize"])
def test_a_periodic_job_for_a_kind_autodiscovery_declares_later_runs(django_db, broker, workers, beats, declared_at):
    # Declared in proj/celery.py, before autodiscovery imports shop/tasks.py: resolved
    # when beat starts (and by the worker at the first tick).
    env = {**SETTINGS, "CL_TEST_NIGHTLY": "shop_nightly", "CL_TEST_NIGHTLY_AT": declared_at}
    workers(django_db, broker, module=PROJECT, extra_env=env)
    beat = beats(django_db, broker, module=PROJECT, extra_env=env)
    wait_for(
        lambda: any(status == "succeeded" for status, _ in _jobs_of(django_db, "shop_nightly")),
        timeout=60,
        interval=0.5,
        what="a nightly job to run",
    )
    assert all(payload == {"from": "beat"} for _, payload in _jobs_of(django_db, "shop_nightly")), beat.log()[-3000:]


def test_beat_refuses_to_start_when_a_periodic_jobs_kind_has_no_handler(django_db, broker, beats):
    # In an on_after_finalize hook, whose errors Celery only logs: beat would run without
    # the entry. It exits instead, naming the entry and the kind.
    env = {**SETTINGS, "CL_TEST_NIGHTLY": "shop_nightlly", "CL_TEST_NIGHTLY_AT": "finalize"}
    beat = beats(django_db, broker, module=PROJECT, extra_env=env)
    try:
        assert beat.proc.wait(timeout=45) != 0, beat.log()
    except subprocess.TimeoutExpired:
        raise AssertionError(f"beat kept running without its periodic job:\n{beat.log()[-3000:]}") from None
    log = beat.log()
    assert "beat refuses to start" in log and "periodic job 'nightly' (kind 'shop_nightlly')" in log, log[-3000:]
    assert "Sending due task nightly" not in log
