"""Celery habits on leased tasks against real `celery worker` / `celery beat` processes,
PostgreSQL and Redis: beat after Django-style configuration, canvas, AsyncResult, revoke
and the events Flower reads."""

from __future__ import annotations

import re

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
