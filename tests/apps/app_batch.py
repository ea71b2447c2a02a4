"""The tests' app plus batched kinds (``batch=N``: worker/many_claim.py), steered by payload:
``sleep`` seconds, ``raise`` (the handler raises), ``nul`` (returns a value the table
cannot hold), ``marker_dir`` (a file per start and per end, with the pid)."""

from __future__ import annotations

import os
import time

from celery_lease import JobContext
from tests.apps.app import _marker, app, leases  # noqa: F401  (app: celery -A finds it here)

LEASE = int(os.environ.get("CL_TEST_LEASE", "30"))


@leases.job(kind="b_note", batch=4, max_attempts=2, lease_seconds=LEASE, retry_backoff=0.1, retry_backoff_max=0.2)
def b_note(ctx: JobContext, payload: dict) -> dict:
    _marker(payload, f"start-{ctx.job_id}-{ctx.attempt}")
    time.sleep(payload.get("sleep", 0))
    if payload.get("raise"):
        raise RuntimeError("poison")
    _marker(payload, f"end-{ctx.job_id}")
    if payload.get("nul"):
        return {"note": "a\x00b"}
    return {"n": payload.get("n"), "attempt": ctx.attempt}
