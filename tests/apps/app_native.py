"""tests.apps.app plus plain Celery tasks and leased steps for the canvas, revoke and
events tests (tests/e2e/test_native_workers.py, tests/integration/test_native.py)."""

from __future__ import annotations

import os
import time

from celery_lease import Failure, JobContext
from tests.apps.app import app, effects, leases
from tests.apps.app_durable import *  # noqa: F403 - the app, leases and the shared handlers


def _touch(directory: str | None, name: str) -> None:
    if directory:
        with open(os.path.join(directory, name), "a") as fh:
            fh.write(f"{os.getpid()}\n")


@leases.job(kind="inc", max_attempts=3, lease_seconds=int(os.environ.get("CL_TEST_LEASE", "6")))
def inc(ctx: JobContext, payload) -> dict:
    """n + 1, for a payload that is n or {"n": n, ...}; the other keys ride along. With
    "slow_at": n, the first attempt at that n waits (long enough to be killed); with
    "fail_at": n, that step raises Failure. Each success writes one effect row."""
    state = {"n": payload} if isinstance(payload, int) else dict(payload)
    n = state["n"]
    _touch(state.get("dir"), f"inc-{n}-{ctx.attempt}")
    if state.get("fail_at") == n:
        raise Failure(f"step {n} failed")
    if state.get("slow_at") == n and ctx.attempt == 1:
        for _ in range(1200):
            ctx.raise_if_cancelled()
            time.sleep(0.05)
    ctx.effect(lambda conn: conn.execute(effects.insert().values(job_id=ctx.job_id, attempt=ctx.attempt, note=f"inc {n}")))
    return {**state, "n": n + 1}


@leases.job(kind="total", max_attempts=1)
def total(ctx: JobContext, payload: list) -> int:
    """A chord body: the sum of the header's n."""
    return sum(item["n"] if isinstance(item, dict) else item for item in payload)


@leases.job(kind="noted_error", max_attempts=1)
def noted_error(ctx: JobContext, payload: dict) -> dict:
    """A leased errback: gets {"job_id", "error"} of the failed job."""
    return {"failed": payload["job_id"], "error": payload["error"]}


@app.task(name="tests.plain_add", shared=False)
def plain_add(x, y):
    return x + y


@app.task(name="tests.plain_bump", shared=False)
def plain_bump(state, marker_dir=None):
    """A plain chain step: n + 10, keeping the other keys; leaves a marker."""
    state = {"n": state} if isinstance(state, int) else dict(state)
    _touch(marker_dir or state.get("dir"), f"plain-{state['n']}")
    return {**state, "n": state["n"] + 10}


@app.task(name="tests.plain_errback", shared=False)
def plain_errback(task_id, marker_dir):
    """A plain errback (Celery's task-id form)."""
    _touch(marker_dir, f"errback-{task_id}")
