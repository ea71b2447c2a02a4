"""A Celery app configured the way Django projects do it, for tests/e2e/test_native_workers.py.

``CeleryLease(app)`` comes first, on an unconfigured app; then the project loads its
settings with ``config_from_object(..., namespace="CELERY")`` and, separately, assigns
``app.conf.beat_schedule = {...}`` (which replaces the whole schedule). A periodic leased
job is declared before either. Environment: CL_TEST_DB, CL_TEST_BROKER, CL_TEST_LEASE, CL_TEST_LATE_SCHEDULE.
"""

from __future__ import annotations

import os
import time

from celery import Celery

from celery_lease import CeleryLease, JobContext

app = Celery("django_style")
leases = CeleryLease(app)


@leases.job(kind="dj_sleep", max_attempts=3, lease_seconds=int(os.environ.get("CL_TEST_LEASE", "4")))
def dj_sleep(ctx: JobContext, payload: dict) -> dict:
    """Sleeps payload["sleep"] seconds in small steps (a worker SIGKILL lands mid-way)."""
    marker = payload.get("marker")
    if marker:
        with open(marker, "a") as fh:
            fh.write(f"{ctx.attempt}\n")
    deadline = time.monotonic() + payload.get("sleep", 0.0)
    while time.monotonic() < deadline:
        ctx.raise_if_cancelled()
        time.sleep(0.05)
    return {"attempt": ctx.attempt}


@leases.job(kind="dj_tick", max_attempts=1)
def dj_tick(ctx: JobContext, payload: dict) -> dict:
    return {"tick": payload.get("n")}


# Declared at import, before the project configures the app.
leases.periodic("dj-tick", "dj_tick", 1.0, {"n": 1})


class DjangoSettings:
    """What django.conf:settings would hold, CELERY_-prefixed."""

    CELERY_BROKER_URL = os.environ.get("CL_TEST_BROKER", "memory://")
    CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
    CELERY_WORKER_PREFETCH_MULTIPLIER = 1
    CELERY_WORKER_HIJACK_ROOT_LOGGER = False
    CELERY_LEASE_DATABASE_URL = os.environ.get("CL_TEST_DB")
    CELERY_LEASE_REAP_INTERVAL = 1.0
    CELERY_LEASE_SWEEP_INTERVAL = 0.5
    CELERY_LEASE_SWEEP_STALE_SECONDS = 2.0


app.config_from_object(DjangoSettings, namespace="CELERY")
if os.environ.get("CL_TEST_LATE_SCHEDULE"):
    # Something read the configuration first (autodiscovery, a setting lookup): the
    # assignment below then replaces a loaded schedule, which no signal reports.
    assert app.conf.broker_url
app.conf.beat_schedule = {"project-entry": {"task": "celery.backend_cleanup", "schedule": 3600.0}}
