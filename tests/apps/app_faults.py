"""The tests' app plus the handlers of the fault tests and the chaos suite.

Run by workers as ``celery -A tests.apps.app_faults worker``; imported in-process through
``client_app(..., module="tests.apps.app_faults")``.
"""

from __future__ import annotations

import os
import time

import sqlalchemy as sa

from celery_lease import JobContext
from tests.apps.app import _marker, app, effects, leases  # noqa: F401  (app: celery -A finds it here)

LEASE = int(os.environ.get("CL_TEST_LEASE", "6"))


@leases.job(kind="waiter", max_attempts=1, lease_seconds=LEASE)
def waiter(ctx: JobContext, payload: dict) -> dict:
    """Polls raise_if_cancelled() without writing anything, so only the heartbeat (or a
    cancel notice waking it) can tell it that its lease is gone."""
    _marker(payload, f"waiter-{ctx.job_id}")
    for _ in range(payload.get("polls", 300)):
        ctx.raise_if_cancelled()
        time.sleep(0.1)
    return {"polled": payload.get("polls", 300)}


@leases.job(
    kind="chaos",
    max_attempts=int(os.environ.get("CL_CHAOS_ATTEMPTS", "6")),
    lease_seconds=LEASE,
    retry_backoff=0.2,
    retry_backoff_max=1.0,
)
def chaos(ctx: JobContext, payload: dict) -> dict:
    """payload["steps"] checkpointed steps of payload["sleep"] seconds, then one effect
    row written in the transaction that records success."""
    start = (ctx.checkpoint or {}).get("i", 0)
    for i in range(start, payload["steps"]):
        ctx.raise_if_cancelled()
        time.sleep(payload["sleep"])
        ctx.save_checkpoint({"i": i + 1})
    ctx.effect(lambda conn: conn.execute(effects.insert().values(job_id=ctx.job_id, attempt=ctx.attempt, note="chaos")))
    return {"steps": payload["steps"], "resumed_from": start, "attempt": ctx.attempt}


@leases.job(kind="pg_wait", max_attempts=3, lease_seconds=LEASE)
def pg_wait(ctx: JobContext, payload: dict) -> dict:
    """Its effect waits payload["seconds"] inside PostgreSQL (pg_sleep), in the success
    transaction, and notes the time the wait ended (epoch seconds): a green worker overlaps these only
    if the driver yields to the hub."""
    wait = sa.text(
        "INSERT INTO test_effects (job_id, attempt, note) "
        "SELECT :job_id, :attempt, extract(epoch FROM clock_timestamp())::text FROM pg_sleep(:seconds)"  # (after the sleep)
    )
    params = {"job_id": ctx.job_id, "attempt": ctx.attempt, "seconds": payload["seconds"]}
    ctx.effect(lambda conn: conn.execute(wait, params))
    return {"attempt": ctx.attempt}
