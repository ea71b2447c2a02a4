"""The tests' app plus handlers that produce values PostgreSQL cannot store, and a
periodic entry, for tests/e2e/test_worker_untrusted.py and tests/e2e/test_beat_workers.py.

Run by workers as ``celery -A tests.apps.app_unstorable worker``; imported in-process
through ``client_app(..., module="tests.apps.app_unstorable")``. A payload may not hold
such values (submit refuses them), so handlers build them from a ``mode`` name.
"""

from __future__ import annotations

from celery_lease import Failure, JobContext
from tests.apps.app import *  # noqa: F403 - the app, leases and the shared handlers
from tests.apps.app import echo, leases

#: Strings PostgreSQL cannot store: NUL (neither text nor jsonb), a lone surrogate
#: (not Unicode text; psycopg2 cannot even encode it).
BAD = {"nul": "before\x00after", "surrogate": "lone \ud800 surrogate"}


@leases.job(kind="unstorable", max_attempts=3, lease_seconds=30, retry_backoff=0.1, retry_backoff_max=0.2)
def unstorable(ctx: JobContext, payload: dict) -> dict:
    """payload["where"] (failure, result, progress, checkpoint, big_result,
    big_progress, none) and payload["mode"] (a key of BAD) choose what goes wrong."""
    where, bad = payload.get("where", "none"), BAD.get(payload.get("mode", ""), "")
    if where == "failure":
        raise Failure(f"gave up: {bad}")
    if where == "progress":
        ctx.publish({"note": bad})
    if where == "big_progress":
        ctx.publish({"blob": "p" * payload["size"]})
    if where == "checkpoint":
        ctx.save_checkpoint({"note": bad})
    if where == "result":
        return {"note": bad}
    if where == "big_result":
        return {"blob": "r" * payload["size"]}
    return {"ok": payload.get("value"), "attempt": ctx.attempt}


# One periodic entry, fired by the tests themselves (no beat process needed).
leases.periodic("bnd-tick", echo, 60, {"value": "tick"})
