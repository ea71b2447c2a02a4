"""Celery habits on leased tasks, in-process: beat entries, results, canvas checks,
eager mode and the pytest plugin (tests/e2e/test_native_workers.py has the worker side)."""

from __future__ import annotations

import logging
import sys

import pytest

# --- beat entries survive the project's configuration -------------------------------------

MAINTENANCE = {"celery_lease.reap", "celery_lease.sweep", "celery_lease.prune"}


@pytest.fixture
def django_app(sqlite_url, monkeypatch):
    """tests.apps.app_django freshly imported; ``late=True`` assigns beat_schedule after
    the configuration was loaded."""
    made = []

    def load(late: bool = False):
        monkeypatch.setenv("CL_TEST_DB", sqlite_url)
        monkeypatch.setenv("CL_TEST_BROKER", "memory://")
        if late:
            monkeypatch.setenv("CL_TEST_LATE_SCHEDULE", "1")
        else:
            monkeypatch.delenv("CL_TEST_LATE_SCHEDULE", raising=False)
        sys.modules.pop("tests.apps.app_django", None)
        import tests.apps.app_django as mod

        made.append(mod)
        return mod

    yield load
    for mod in made:
        mod.leases.store.dispose()
        mod.app.close()
    sys.modules.pop("tests.apps.app_django", None)


def test_entries_survive_config_from_object_and_a_lazy_schedule_assignment(django_app):
    mod = django_app()
    schedule = mod.app.conf.beat_schedule
    # CeleryLease(app) and leases.periodic() ran before the project configured the app.
    assert MAINTENANCE | {"dj-tick", "project-entry"} <= set(schedule)
    assert schedule["celery_lease.reap"]["schedule"] == 1.0  # CELERY_LEASE_REAP_INTERVAL was read
    # A second config_from_object reloads the configuration: still there.
    mod.app.config_from_object(mod.DjangoSettings, namespace="CELERY")
    assert MAINTENANCE | {"dj-tick"} <= set(mod.app.conf.beat_schedule)


def test_beat_puts_back_entries_a_late_assignment_dropped_and_names_them(django_app, tmp_path, caplog):
    from celery import signals
    from celery.beat import Service

    mod = django_app(late=True)
    assert set(mod.app.conf.beat_schedule) == {"project-entry"}  # what the assignment left
    service = Service(app=mod.app, schedule_filename=str(tmp_path / "beat-schedule"))
    scheduler = service.scheduler  # beat reads the schedule before beat_init, as `celery beat` does
    assert "celery_lease.reap" not in scheduler.schedule
    with caplog.at_level(logging.WARNING, logger="celery_lease.maintenance"):
        signals.beat_init.send(sender=service)
    assert MAINTENANCE | {"dj-tick", "project-entry"} <= set(scheduler.schedule)
    assert scheduler.schedule["celery_lease.sweep"].options["queue"] == "celery_lease"
    warned = [r.getMessage() for r in caplog.records if "beat schedule had no" in r.getMessage()]
    assert len(warned) == 1 and "celery_lease.reap" in warned[0] and "dj-tick" in warned[0]
    # Nothing missing at the next start: no warning.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="celery_lease.maintenance"):
        signals.beat_init.send(sender=service)
    assert not [r for r in caplog.records if "beat schedule had no" in r.getMessage()]
    service.scheduler.close()


def test_maintenance_ticks_are_logged_at_debug_other_tasks_at_info():
    from celery_lease.beat.entries import quiet_maintenance_logs

    quiet_maintenance_logs()
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Keep(level=logging.DEBUG)
    trace = logging.getLogger("celery.app.trace")
    trace.addHandler(handler)
    old = trace.level
    trace.setLevel(logging.DEBUG)
    try:
        for name in ("celery_lease.sweep", "proj.tasks.add"):
            trace.info(
                "Task %(name)s[%(id)s] succeeded in %(runtime)ss: %(return_value)s",
                {"name": name, "id": "x", "runtime": 0.1, "return_value": None},
            )
        logging.getLogger("celery.beat").info("Scheduler: Sending due task %s (%s)", "celery_lease.reap", "celery_lease.reap")
        trace.setLevel(logging.INFO)
        trace.info("Task %(name)s[%(id)s] received", {"name": "celery_lease.reap", "id": "y"})
    finally:
        trace.removeHandler(handler)
        trace.setLevel(old)
    levels = [(r.args["name"], r.levelname) for r in records if isinstance(r.args, dict)]
    # At DEBUG the tick shows as a DEBUG line; at INFO it is not written at all.
    assert levels == [("celery_lease.sweep", "DEBUG"), ("proj.tasks.add", "INFO")]
