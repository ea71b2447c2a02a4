"""The boundaries app plus a plain task and a handler that waits to be cancelled, for
tests/e2e/test_worker_security.py (issue 19)."""

from __future__ import annotations

import os
import time

from celery_lease import JobContext
from tests.apps.app_unstorable import *  # noqa: F403 - the app, leases, handlers, the "bnd-tick" entry
from tests.apps.app_unstorable import app, leases


@app.task(name="tests.plain_pass", shared=False)
def plain_pass(value=None):
    """A plain task: Celery applies the chain and callbacks its message carries."""
    return value


@leases.job(kind="until_cancelled", max_attempts=1, lease_seconds=30)
def until_cancelled(ctx: JobContext, payload: dict) -> dict:
    """Waits (up to a minute) until its context reports the cancel, then leaves a marker
    with the time it noticed. A 30 s lease renews every 10 s: noticing sooner takes the
    cancel notice."""
    path = os.path.join(payload["marker_dir"], f"started-{ctx.job_id}")
    open(path, "w").close()
    deadline = time.monotonic() + 60
    while not ctx.cancelled and time.monotonic() < deadline:
        time.sleep(0.02)
    with open(os.path.join(payload["marker_dir"], f"noticed-{ctx.job_id}"), "w") as fh:
        fh.write(repr(time.time()))
    return {}
