"""tests.apps.app_faults plus the handlers of the liveness tests (tests/e2e/test_worker_liveness_faults.py,
tests/e2e/test_lifecycle_faults.py) and the chaos scenario's long kind (tests/harness/chaos.py).

Run by workers as ``celery -A tests.apps.app_leases worker``; imported in-process through
``client_app(..., module="tests.apps.app_leases")``.
"""

from __future__ import annotations

import os
import time

from celery_lease import Failure, JobContext
from tests.apps.app import *  # noqa: F403 - the shared handlers (echo, steps, sleepy...)
from tests.apps.app import _marker, effects, leases
from tests.apps.app_faults import *  # noqa: F403 - the app, leases and the fault handlers

#: How long a handler waits for its gate file before giving up (a test bug, not a pass).
GATE_TIMEOUT = 120.0


def _gate(payload: dict, ctx: JobContext) -> None:
    """Wait (without cooperating) until the file payload["gate"] exists."""
    gate = payload.get("gate")
    if not gate:
        return
    deadline = time.monotonic() + GATE_TIMEOUT
    while not os.path.exists(gate):
        if time.monotonic() > deadline:
            raise RuntimeError("gate never opened")
        time.sleep(0.05)


def _poll(ctx: JobContext, seconds: float) -> None:
    """Poll raise_if_cancelled for ``seconds`` without writing: only the heartbeat (or
    the attempt's own clock) can tell the handler its lease is gone."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        ctx.raise_if_cancelled()
        time.sleep(0.05)


@leases.job(kind="long_lease", max_attempts=1, lease_seconds=60)
def long_lease(ctx: JobContext, payload: dict) -> dict:
    """A 60 s lease: the heartbeat of its process then sleeps 20 s between rounds."""
    _marker(payload, f"long-{ctx.job_id}")
    _poll(ctx, payload.get("seconds", 0.5))
    return {"pid": os.getpid()}


@leases.job(kind="short_lease", max_attempts=1, lease_seconds=3)
def short_lease(ctx: JobContext, payload: dict) -> dict:
    """A 3 s lease held for payload["seconds"]: it needs a renewal every second."""
    _marker(payload, f"short-{ctx.job_id}")
    _poll(ctx, payload.get("seconds", 8))
    return {"pid": os.getpid()}


@leases.job(kind="stale", max_attempts=2, lease_seconds=int(os.environ.get("CL_TEST_LEASE", "300")), retry_backoff=0.1)
def stale(ctx: JobContext, payload: dict) -> dict:
    """Waits (not cooperating) for payload["gate"], then ends as payload["end"] says:
    "plain" (a batched success), "effect" (a success with an effect row), "fail"
    (Failure), "raise" (an error: retry), "progress" (publishes, then reports whether
    its context says cancelled)."""
    _marker(payload, f"stale-{ctx.job_id}-{ctx.attempt}")
    end = payload.get("end", "plain")
    if ctx.attempt == 1:
        _gate(payload, ctx)
    if end == "effect":
        ctx.effect(lambda conn: conn.execute(effects.insert().values(job_id=ctx.job_id, attempt=ctx.attempt, note="stale")))
    elif end == "fail" and ctx.attempt == 1:
        raise Failure("stale failure")
    elif end == "raise" and ctx.attempt == 1:
        raise RuntimeError("stale error")
    elif end == "progress" and ctx.attempt == 1:
        ctx.publish({"stale": True})
        ctx.flush_progress()
        _marker(payload, f"progress-{ctx.job_id}-cancelled={ctx.cancelled}")
    return {"attempt": ctx.attempt}


@leases.job(kind="poller", max_attempts=3, lease_seconds=int(os.environ.get("CL_TEST_LEASE", "6")), retry_backoff=0.1)
def poller(ctx: JobContext, payload: dict) -> dict:
    """Polls raise_if_cancelled for payload["seconds"] (first attempt) or payload["then"]
    (later ones) without writing anything."""
    _marker(payload, f"poller-{ctx.job_id}-{ctx.attempt}")
    _poll(ctx, payload.get("seconds", 30) if ctx.attempt == 1 else payload.get("then", 0.5))
    return {"attempt": ctx.attempt, "pid": os.getpid()}


@leases.job(kind="slow_effect", max_attempts=3, lease_seconds=int(os.environ.get("CL_TEST_LEASE", "6")))
def slow_effect(ctx: JobContext, payload: dict) -> dict:
    """Its success transaction holds the job's row lock for payload["sleep"] seconds
    (a slow effect), longer than its lease."""
    _marker(payload, f"slow-{ctx.job_id}-{ctx.attempt}")
    attempt = ctx.attempt

    def slow(conn):
        time.sleep(payload.get("sleep", 5))
        conn.execute(effects.insert().values(job_id=ctx.job_id, attempt=attempt, note="slow"))

    ctx.effect(slow)
    return {"attempt": attempt}


@leases.job(kind="hung", max_attempts=2, lease_seconds=30, timeout=2, retry_backoff=0.1)
def hung(ctx: JobContext, payload: dict) -> dict:
    """Attempt 1 hangs for payload["seconds"]: polling raise_if_cancelled when
    payload["cooperative"], else sleeping through it. Later attempts return at once."""
    _marker(payload, f"hung-{ctx.job_id}-{ctx.attempt}")
    if ctx.attempt == 1:
        if payload.get("cooperative"):
            _poll(ctx, payload["seconds"])
        else:
            time.sleep(payload["seconds"])
    return {"attempt": ctx.attempt}


@leases.job(kind="hung_once", max_attempts=1, lease_seconds=30, timeout=1)
def hung_once(ctx: JobContext, payload: dict) -> dict:
    _poll(ctx, payload.get("seconds", 30))
    return {"attempt": ctx.attempt}


@leases.job(
    kind="chaos_long",
    max_attempts=int(os.environ.get("CL_CHAOS_ATTEMPTS", "6")),
    lease_seconds=int(os.environ.get("CL_TEST_LONG_LEASE", "30")),
    retry_backoff=0.2,
    retry_backoff_max=1.0,
)
def chaos_long(ctx: JobContext, payload: dict) -> dict:
    """The chaos job with a long lease, run by the same workers as the short one."""
    from tests.apps.app_faults import chaos as short

    return short.spec.fn(ctx, payload)


@leases.job(kind="slow_timeout", max_attempts=2, lease_seconds=30, timeout=1)
def slow_timeout(ctx: JobContext, payload: dict) -> dict:
    """Returns at once; its success transaction then holds the job's row lock for
    payload["sleep"] seconds (a slow effect), past the kind's 1 s timeout."""
    attempt = ctx.attempt

    def slow(conn):
        time.sleep(payload.get("sleep", 4))
        conn.execute(effects.insert().values(job_id=ctx.job_id, attempt=attempt, note="slow_timeout"))

    ctx.effect(slow)
    return {"attempt": attempt}


@leases.job(kind="hung_limited", max_attempts=2, lease_seconds=30, timeout=1, concurrency=1, retry_backoff=0.1)
def hung_limited(ctx: JobContext, payload: dict) -> dict:
    """One at a time; attempt 1 sleeps payload["hang"] seconds (not cooperating) past its
    1 s timeout, then marks that it woke."""
    _marker(payload, f"hl-{ctx.job_id}-{ctx.attempt}")
    if ctx.attempt == 1 and payload.get("hang"):
        time.sleep(payload["hang"])
        _marker(payload, f"hl-late-{ctx.job_id}")
    return {"attempt": ctx.attempt}


@leases.job(kind="snooze_gate", max_attempts=1, lease_seconds=30)
def snooze_gate(ctx: JobContext, payload: dict) -> dict:
    """Attempt 1 waits for payload["gate"], then snoozes 0.5 s once (a marker file says
    it did); the next run returns."""
    snoozed = os.path.join(payload["marker_dir"], f"snoozed-{ctx.job_id}")
    if not os.path.exists(snoozed):
        _gate(payload, ctx)
        open(snoozed, "w").close()
        ctx.snooze(0.5)
    return {"attempt": ctx.attempt}
