"""What a delivery ends with must not outlive its trace.

Celery's trace keeps the exception a task ends with (Ignore for a skipped delivery,
Retry, or our JobFailed) in a reference cycle through its own frame and billiard's copy
of the traceback, some 2,400 objects; left to the garbage collector, a pool process grew
by ~100 KB per skipped delivery (duplicate wakeups, held jobs, cancelled jobs) to 200+
MB. These run Celery's own tracer (what a pool process runs per message) on real
deliveries with the garbage collector off, and look at what only it could free: none of
it may be a frame of Celery's trace. (Counting all of it was flaky: threads that
earlier tests of the process left running make garbage of their own while the
collector is off; a full run once counted 845 objects for one RETRY.)
"""

from __future__ import annotations

import gc
import os
import time
import types

from celery import signals
from celery.app.trace import build_tracer

from celery_lease import Status

#: Celery's trace function: the frame whose locals hold the task's exception again.
TRACE_FILE = os.path.join("celery", "app", "trace.py")


def _trace(task, job_id: str) -> tuple[str, int]:
    """Run one delivery of ``job_id`` as a pool process would: (the state it ended in,
    how many of the objects only the garbage collector could free are frames of Celery's
    trace: the cycle through the trace frame, billiard's copy of the traceback and the
    exception, some 2,400 objects, is one of them)."""
    states: list[str] = []

    def note(sender=None, task_id=None, state=None, **_):
        if task_id == job_id:
            states.append(state)

    signals.task_postrun.connect(note, weak=False)
    tracer = build_tracer(task.name, task, app=task.app, eager=False)
    request = {"id": job_id, "delivery_info": {"routing_key": "celery"}, "hostname": "celery@trace-test"}
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector finds unreachable lands in gc.garbage
    try:
        tracer(job_id, (), {}, request)  # its (R, I, T, Rstr) dropped at once, as the pool does
        gc.collect()
        trace_frames = sum(1 for o in gc.garbage if isinstance(o, types.FrameType) and o.f_code.co_filename.endswith(TRACE_FILE))
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if enabled:
            gc.enable()
        signals.task_postrun.disconnect(note)
    (state,) = states
    return state, trace_frames


def test_a_skipped_delivery_leaves_no_cycle(pg, broker, client_app):
    mod = client_app(pg, broker)
    # The first delivery of a process may leave one-off garbage (an app's first claim
    # builds caches and connections); the cycle this test guards is per delivery, so
    # the second delivery is the one measured.
    for value in (1, 2):
        job = mod.echo.submit({"value": value})
        assert mod.leases.cancel(job.id)
        state, frames = _trace(mod.echo, job.id)  # the claim finds it cancelled: Ignore
        assert state == "IGNORED"
    assert frames == 0, f"{frames} frames of Celery's trace left for the garbage collector"


def _deliver(mod, job_id: str) -> tuple[str, int]:
    """One delivery of the pending ``job_id``, once its retry's backoff has passed."""
    pending = mod.leases.get(job_id)
    assert pending.status is Status.PENDING
    if pending.run_after is not None:  # the retry's backoff (0.1-0.2 s), database clock on this host
        time.sleep(max(0.0, pending.run_after.timestamp() - time.time()) + 0.05)
    return _trace(mod.flaky, job_id)


def test_retries_and_failures_leave_no_cycle(pg, broker, client_app):
    mod = client_app(pg, broker)
    # As above, the process's first deliveries of a retry and a success are not measured
    # (a full run once counted 819 objects for the first RETRY: caches and prepared
    # statements built once).
    warm = mod.flaky.submit({"ok_at": 2})
    assert [_deliver(mod, warm.id)[0] for _ in range(2)] == ["RETRY", "SUCCESS"]
    job = mod.flaky.submit({"ok_at": 99})  # raises on every one of its 3 attempts
    states = []
    for _ in range(3):
        state, frames = _deliver(mod, job.id)
        states.append(state)
        assert frames == 0, f"{state}: {frames} frames of Celery's trace left for the garbage collector"
    assert states == ["RETRY", "RETRY", "FAILURE"]
    assert mod.leases.get(job.id).status is Status.FAILED
