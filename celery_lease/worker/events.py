"""What Celery's task events (and so Flower) say about a leased job.

Celery's own events describe the wakeup message, which carries no arguments and whose
execution ends however the job did; these fill in the job's truth:

* when an attempt starts: a ``task-started`` event carrying the attempt as ``retries``
  (attempt - 1), the payload as ``args`` (or the ``argsrepr=`` given at submit) and
  ``{"attempt", "max_attempts"}`` as ``kwargs``. Flower merges it into the task it shows.
* when an attempt stops because the job was cancelled (``leases.cancel``, ``revoke``), or
  a wakeup arrives for a cancelled job: ``task-revoked``, so Flower shows REVOKED; the
  body then raises Celery's ``Ignore`` so no ``task-succeeded`` follows.
* when a wakeup finds its job held (a pause, a concurrency or rate limit) or not yet
  due: ``task-held``, so Flower shows HELD instead of the STARTED Celery announced.

Celery's event state (which Flower uses) ranks states: after a custom one (PROGRESS from
``task-progress``, HELD) only SUCCESS or FAILURE would replace it, and a REVOKED or
STARTED event would merely be merged into it. Such an event's fields are merged whole,
though, so ``task-revoked`` and the attempt's ``task-started`` carry ``state`` explicitly:
a job cancelled after publishing progress shows REVOKED, a held job that runs STARTED.

Sent only when the worker sends task events (``-E`` / ``worker_send_task_events``).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from celery import Celery, signals, states
from celery.utils.saferepr import saferepr

if TYPE_CHECKING:
    from celery import Task

    from celery_lease.worker.attempt import Attempt

log = logging.getLogger("celery_lease")

#: Longest payload repr put in an event, as Celery's argsrepr.
MAX_REPR = 1024


def enabled(task: Task) -> bool:
    # Read once per process (a pool process reads it after the fork, when the worker's
    # -E is recorded): a lookup in Celery's configuration costs more than a no-op job.
    app: Any = task.app
    cached = getattr(app, "_celery_lease_events_enabled", None)
    if cached is None or cached[0] != os.getpid():
        cached = app._celery_lease_events_enabled = (os.getpid(), bool(app.conf.worker_send_task_events))
    return cached[1]


def attempt_started(task: Task, attempt: Attempt) -> None:
    """Never raises: it is sent after the claim committed, and an exception here (the
    broker unreachable) would end the delivery before the body, leaving the job
    running with no body until its lease expired. Events are a view; the row is the truth."""
    if not enabled(task):
        return
    argsrepr = (attempt.canvas or {}).get("argsrepr")
    try:
        task.send_event(
            "task-started",
            state=states.STARTED,
            retries=max(attempt.attempt - 1, 0),
            args=argsrepr if isinstance(argsrepr, str) else saferepr([attempt.payload], MAX_REPR),
            kwargs=saferepr({"attempt": attempt.attempt, "max_attempts": attempt.max_attempts}),
        )
    except Exception as exc:
        log.warning("celery-lease: job %s: task-started event not sent (%s)", attempt.job_id, type(exc).__name__)


def revoked(task: Task) -> None:
    if enabled(task):
        task.send_event("task-revoked", terminated=False, signum=None, expired=False, state=states.REVOKED)


#: At most this many ids are announced per cancel (a cancelled run may hold many more).
MAX_ANNOUNCED = 1000


def announce_revoked(app: Celery, job_ids: list[str]) -> None:
    """From the process that cancelled the jobs: ``task-revoked`` for each, when this app
    sends task events (``worker_send_task_events``, e.g. Django settings shared by web and
    workers), so Flower shows REVOKED for a job no worker holds (pending, held by a
    pause). Best-effort: the row is the truth."""
    if not job_ids or not app.conf.worker_send_task_events:
        return
    try:
        with app.events.default_dispatcher() as dispatcher:
            for job_id in job_ids[:MAX_ANNOUNCED]:
                dispatcher.send("task-revoked", uuid=job_id, terminated=False, signum=None, expired=False, state=states.REVOKED)
    except Exception as exc:  # the broker is down: nothing else depends on this event
        log.warning("celery-lease: cannot announce %d cancelled job(s) to task events (%s)", len(job_ids), type(exc).__name__)


def held(task: Task) -> None:
    if enabled(task):
        task.send_event("task-held")


def connect(app: Celery) -> None:
    """``celery worker -E`` enables task events on the worker object only; record it in the
    app's configuration before the pool forks, so the pool processes see it too."""

    @signals.celeryd_after_setup.connect(weak=False)
    def note_task_events(sender=None, instance: Any = None, **_):
        if instance is not None and instance.app is app and instance.task_events:
            app.conf.worker_send_task_events = True
            app._celery_lease_events_enabled = None  # read again

    app._celery_lease_event_handlers = (note_task_events,)
