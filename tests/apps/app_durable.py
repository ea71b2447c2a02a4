"""tests.apps.app plus the handlers of the durable-execution tests (tests/test_durable.py).

Workers run it with ``module="tests.apps.app_durable"``; every tests.apps.app handler is here too.
"""

from __future__ import annotations

import os
import time

import sqlalchemy as sa

from celery_lease import CheckpointTooLarge, Failure, JobContext
from tests.apps.app import *  # noqa: F403 - the app, leases and the shared handlers
from tests.apps.app import effects, leases

#: How long a gated handler waits for its gate before giving up (a test bug, not a pass).
GATE_TIMEOUT = 120.0


def _touch(directory: str, name: str, text: str = "") -> None:
    with open(os.path.join(directory, name), "a") as fh:
        fh.write(f"{os.getpid()} {text}\n")


@leases.job(kind="gated", max_attempts=3, lease_seconds=int(os.environ.get("CL_TEST_GATED_LEASE", "30")))
def gated(ctx: JobContext, payload: dict) -> dict:
    """Non-cooperative: waits for the file ``open-{attempt}`` (or ``open``) in
    payload["dir"], never checking for cancellation, then writes payload["rows"]
    effect rows in its success transaction. Lets a test hold an attempt mid-body."""
    directory = payload["dir"]
    _touch(directory, f"gated-{ctx.attempt}")
    deadline = time.monotonic() + GATE_TIMEOUT
    while not any(os.path.exists(os.path.join(directory, g)) for g in (f"open-{ctx.attempt}", "open")):
        if time.monotonic() > deadline:
            raise RuntimeError("gate never opened")
        time.sleep(0.05)
    attempt = ctx.attempt
    ctx.effect(
        lambda conn: conn.execute(
            effects.insert(),
            [{"job_id": ctx.job_id, "attempt": attempt, "note": f"row {i}"} for i in range(payload.get("rows", 3))],
        )
    )
    return {"attempt": attempt}


@leases.job(kind="chatty", max_attempts=1)
def chatty(ctx: JobContext, payload: dict) -> dict:
    """Calls ctx.publish payload["n"] times in a tight loop and counts how many progress
    UPDATEs reached the database (on any engine of this process)."""
    engine = sa.engine.Engine
    writes = []

    def count(conn, cursor, statement, parameters, context, executemany):
        if statement.startswith("UPDATE celery_lease_jobs SET progress="):
            writes.append(statement)

    sa.event.listen(engine, "before_cursor_execute", count)
    started = time.monotonic()
    try:
        for i in range(payload["n"]):
            ctx.publish({"i": i + 1})
    finally:
        elapsed = time.monotonic() - started
        sa.event.remove(engine, "before_cursor_execute", count)
    return {"writes": len(writes), "elapsed": elapsed, "unwritten_at_return": ctx.pending_progress is not None}


@leases.job(kind="ckpt", max_attempts=2, retry_backoff=0.1, retry_backoff_max=0.2)
def ckpt(ctx: JobContext, payload: dict) -> dict:
    """Checkpoint scenarios, by payload["mode"]:

    retry  attempt 1 saves {"from": 1} and raises; later attempts return what they saw
    fail   saves {"kept": true}, then raises Failure
    cap    saves {"a": 1}, then tries a checkpoint of payload["big"] bytes; reports
           the refusal by raising Failure with its message
    """
    if payload.get("dir"):
        _touch(payload["dir"], f"ckpt-{ctx.attempt}")
    mode = payload["mode"]
    if mode == "retry":
        if ctx.attempt == 1:
            ctx.save_checkpoint({"from": 1})
            raise RuntimeError("first attempt breaks after its checkpoint")
        return {"seen": ctx.checkpoint, "attempt": ctx.attempt}
    if mode == "fail":
        ctx.save_checkpoint({"kept": True})
        raise Failure("stopped after a checkpoint")
    if mode == "cap":
        ctx.save_checkpoint({"a": 1})
        try:
            ctx.save_checkpoint({"blob": "x" * payload["big"]})
        except CheckpointTooLarge as exc:
            raise Failure(f"refused: {exc}")
        return {"refused": False}
    raise Failure(f"unknown mode {mode!r}")


@leases.job(kind="parent_effect_fails", max_attempts=1)
def parent_effect_fails(ctx: JobContext, payload: dict) -> dict:
    """Stages children and an effect row, then an effect that raises: the success
    transaction must roll back, taking the children and the row with it."""
    for value in payload.get("children", []):
        ctx.submit("echo", {"value": value})
    ctx.effect(lambda conn: conn.execute(effects.insert().values(job_id=ctx.job_id, attempt=ctx.attempt)))

    def broken(conn):
        raise RuntimeError("effect failed: password=hunter2")

    ctx.effect(broken)
    return {"children": len(payload.get("children", []))}


@leases.job(kind="parent_keyed", max_attempts=1)
def parent_keyed(ctx: JobContext, payload: dict) -> dict:
    """Submits one echo child per key in payload["keys"], with that idempotency key."""
    for key in payload["keys"]:
        ctx.submit("echo", {"value": key}, idempotency_key=key)
    return {"children": len(payload["keys"])}


# One beat entry for tests/test_durable.py's two-beat test; idle unless a beat runs.
leases.periodic("durable-tick", "echo", float(os.environ.get("CL_TEST_PERIOD", "2")), {"value": "tick"})
