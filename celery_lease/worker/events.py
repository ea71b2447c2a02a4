"""What Celery's task events (and so Flower) say about a leased job (docs/coming-from-celery.md).

Celery's own events describe the wakeup message, which carries no arguments and ends
however the job did; these fill in the job's truth: ``task-started`` per attempt (the
attempt as ``retries``, the payload as ``args``), ``task-revoked`` when the job was
cancelled (the body then raises ``Ignore``, so no ``task-succeeded`` follows), and
``task-held`` when a wakeup finds its job held or not yet due. A many-job claim's other
jobs get their own events from :class:`ManyClaimTasks`, so Flower lists each as a task.
The rule: ``task-revoked`` and an attempt's ``task-started`` carry ``state`` explicitly,
since Celery's event state only merges them into a custom state (PROGRESS, HELD).
Sent only when the worker sends task events (``-E`` / ``worker_send_task_events``).
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import TYPE_CHECKING, Any

from celery import Celery, signals, states
from celery.utils.saferepr import saferepr

from celery_lease.status import Status
from celery_lease.worker.outcome import Outcome

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
    try:
        task.send_event("task-started", state=states.STARTED, **_described(attempt))
    except Exception as exc:
        log.warning("celery-lease: job %s: task-started event not sent (%s)", attempt.job_id, type(exc).__name__)


def _described(attempt: Attempt) -> dict[str, Any]:
    """The fields that describe an attempt's job in its ``task-started`` event."""
    argsrepr = (attempt.canvas or {}).get("argsrepr")
    return {
        "retries": max(attempt.attempt - 1, 0),
        "args": argsrepr if isinstance(argsrepr, str) else saferepr([attempt.payload], MAX_REPR),
        "kwargs": saferepr({"attempt": attempt.attempt, "max_attempts": attempt.max_attempts}),
    }


#: The fields of a cancelled job's ``task-revoked`` (a durable cancel, not a terminate).
#: ``state`` is explicit (so is task-started's): after a custom state (PROGRESS, HELD),
#: Celery's event state ranks REVOKED and STARTED lower and only merges their fields.
_REVOKED = {"terminated": False, "signum": None, "expired": False, "state": states.REVOKED}


def revoked(task: Task) -> None:
    if enabled(task):
        task.send_event("task-revoked", **_REVOKED)


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
                dispatcher.send("task-revoked", uuid=job_id, **_REVOKED)
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


class ManyClaimTasks:
    """The task events of the jobs a many-job claim's delivery runs besides its own (which Celery
    reports): each is announced as a task of its own, under its job id, by the worker
    that runs it, in one dispatcher for the claim. A view: never raises (the broker
    unreachable costs the events, not the jobs), and sends nothing without ``-E``."""

    def __init__(self, task: Task) -> None:
        self._task = task
        self._stack = contextlib.ExitStack()
        self._dispatcher: Any = None
        self._failed = False

    @classmethod
    def of(cls, task: Task) -> ManyClaimTasks | None:
        return cls(task) if enabled(task) else None

    def started(self, attempt: Attempt) -> None:
        """Received and started at once: the job left the broker's view with the
        delivery's message; it starts when its turn in the claim comes."""
        described = _described(attempt)
        canvas = attempt.canvas or {}
        self._send(
            "task-received",
            attempt.job_id,
            name=self._task.name,
            args=described["args"],
            kwargs=described["kwargs"],
            retries=described["retries"],
            root_id=canvas.get("root_id") or attempt.job_id,
            parent_id=canvas.get("parent_id") or attempt.parent_id,
            eta=None,
            expires=None,
        )
        self._send("task-started", attempt.job_id, state=states.STARTED, **described)

    def succeeded(self, attempt: Attempt, value: Any, runtime: float) -> None:
        self._send("task-succeeded", attempt.job_id, result=saferepr(value, MAX_REPR), runtime=runtime)

    def retried(self, attempt: Attempt, exc: Exception) -> None:
        """``exc``: Celery's Retry the attempt raised (its ``exc`` carries the stored,
        text-free error, as the delivery's own task-retried does)."""
        self._send("task-retried", attempt.job_id, exception=saferepr(getattr(exc, "exc", None) or exc), traceback="")

    def failed(self, attempt: Attempt, exc: Exception) -> None:
        self._send("task-failed", attempt.job_id, exception=saferepr(exc), traceback="")

    def stopped(self, attempt: Attempt) -> None:
        """An attempt that ended without an outcome Celery names, by its job's status:
        cancelled, REVOKED; pending again (snoozed, handed off), HELD. A lease lost
        unnoticed leaves no outcome: the row says which."""
        if attempt.outcome is Outcome.CANCELLED:
            status: Status | None = Status.CANCELLED
        elif attempt.outcome in (Outcome.SNOOZED, Outcome.SUSPENDED):
            status = Status.PENDING
        else:
            try:
                job = self._task.owner.get(attempt.job_id)  # (a LeaseTask's owner)
            except Exception:  # (the database away: the event is a view, the row the truth)
                return
            status = None if job is None else job.status
        if status is Status.CANCELLED:
            self._send("task-revoked", attempt.job_id, **_REVOKED)
        elif status is Status.PENDING:
            self._send("task-held", attempt.job_id)

    def close(self) -> None:
        try:
            self._stack.close()  # (its producer goes back to the pool)
        except Exception as exc:
            log.warning("celery-lease: a batch's event dispatcher not closed cleanly (%s)", type(exc).__name__)

    def _send(self, type_: str, job_id: str, **fields: Any) -> None:
        if self._failed:
            return  # the broker refused this batch's events once: the rest are not tried
        task = self._task
        try:
            if self._dispatcher is None:
                self._dispatcher = self._stack.enter_context(task.app.events.default_dispatcher(hostname=task.request.hostname))
            self._dispatcher.send(type_, uuid=job_id, retry=True, retry_policy=task.app.conf.task_publish_retry_policy, **fields)
        except Exception as exc:
            self._failed = True
            log.warning("celery-lease: job %s: %s event not sent (%s)", job_id, type_, type(exc).__name__)
