"""Celery's result API over the job rows: ``AsyncResult(job.id).state`` and ``.get()``.

:class:`LeaseBackend` is a Celery result backend that reads a job's row. ``CeleryLease``
makes it the app's result backend when the app has none (``result_backend`` unset), so
``app.AsyncResult(job_id)``, ``celery.result.AsyncResult(job_id)``, chains' and groups'
results and chords all work with no other setting. An app with its own result backend
keeps it for its plain tasks; leased tasks still answer through this one (each leased
task's ``backend``), and ``leases.AsyncResult(job_id)`` reads a job from anywhere.

States, from the row:

==============================  ==========  ==================================
job                             state       ``.result`` / what ``.get()`` does
==============================  ==========  ==================================
pending, never attempted        PENDING     None (also for an unknown id)
pending after a failed attempt  RETRY       None
running                         STARTED     the job's progress (``ctx.publish``)
succeeded                       SUCCESS     the stored result
failed / expired                FAILURE     ``JobFailed(stored error)``, raised by ``.get()``
cancelled (or revoked)          REVOKED     ``TaskRevokedError``, raised by ``.get()``
==============================  ==========  ==================================

Plain tasks' results are not stored by this backend (as with no backend at all): give
the app a result backend of its own for those.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from celery import states
from celery.backends.base import BaseBackend
from celery.result import AsyncResult

from celery_lease.errors import ConfigurationError
from celery_lease.job import Job, parse_job_id
from celery_lease.status import Status

#: What ``result_backend`` is set to when the app has none.
BACKEND = "celery_lease.results:LeaseBackend"

_STATE = {
    Status.PENDING: states.PENDING,
    Status.RUNNING: states.STARTED,
    Status.SUCCEEDED: states.SUCCESS,
    Status.FAILED: states.FAILURE,
    Status.EXPIRED: states.FAILURE,
    Status.CANCELLED: states.REVOKED,
}


def state_of(job: Job | None) -> str:
    if job is None:
        return states.PENDING
    if job.status is Status.PENDING and job.attempt > 0:
        return states.RETRY
    return _STATE[job.status]


def meta_of(task_id: str, job: Job | None) -> dict[str, Any]:
    """Celery's task meta for a job (or for no job: PENDING)."""
    meta: dict[str, Any] = {"task_id": task_id, "status": state_of(job), "result": None, "traceback": None, "children": []}
    if job is None:
        return meta
    if job.status is Status.SUCCEEDED:
        meta["result"] = job.result
    elif job.status is Status.RUNNING:
        meta["result"] = job.progress
    else:
        meta["result"] = job.exception()
    meta.update(
        date_done=job.finished_at,
        name=job.task,
        args=[job.payload],
        kwargs={},
        worker=job.lease_owner,
        retries=max(job.attempt - 1, 0),
        queue=job.queue,
    )
    return meta


def _leases(app) -> Any:
    leases = getattr(app, "lease", None)
    if leases is None:
        raise ConfigurationError("celery_lease.results:LeaseBackend needs CeleryLease(app) on this app")
    return leases


#: Set on the thread running Celery's ``revoke`` control command (worker/revoke.py).
#: Celery then reads each revoked id's state to decide whether to store REVOKED: this
#: backend drops Celery's writes, so the reads (one job read per id, on the worker's
#: consumer: a broadcast of 3,000 ids stalled ``ping`` for 15 s) decide nothing.
_revoking = threading.local()


@contextlib.contextmanager
def reads_skipped() -> Iterator[None]:
    """Inside: the backend answers PENDING for every id without reading its row."""
    _revoking.active = True
    try:
        yield
    finally:
        _revoking.active = False


class LeaseBackend(BaseBackend):
    """A result backend whose results are the job rows."""

    supports_native_join = False
    persistent = True

    def __init__(self, app=None, url=None, **kwargs: Any) -> None:
        super().__init__(app, url=url, **kwargs)

    def _ensure_not_eager(self) -> None:
        pass  # eager jobs have rows too: their results are real

    def _get_task_meta_for(self, task_id: str) -> dict[str, Any]:
        if getattr(_revoking, "active", False):
            return meta_of(task_id, None)
        try:
            job_id = parse_job_id(task_id)
        except ValueError:
            return meta_of(task_id, None)
        return meta_of(task_id, _leases(self.app).get(job_id))

    # Results are written by the lease life itself; Celery's own writes are dropped.
    def _store_result(self, task_id, result, state, traceback=None, request=None, **kwargs) -> Any:
        return result

    def _forget(self, task_id) -> None:
        pass

    def cleanup(self) -> None:
        pass  # pruning is celery-lease's (lease_retention_seconds)

    def apply_chord(self, header_result_args, body, **kwargs) -> None:
        """Before the header is applied: the chord's counter row (canvas.py)."""
        group_id, results = header_result_args[0], list(header_result_args[1])
        # A leased task's frozen result is a LeaseResult (LeaseTask.AsyncResult).
        if not all(isinstance(r, LeaseResult) for r in results):
            raise TypeError(
                "with celery-lease as the result backend, a chord's header tasks must all be leased tasks; "
                "give the app a result backend of its own for chords of plain tasks"
            )
        _leases(self.app).canvas.create_chord(group_id, [r.id for r in results], body)

    def set_chord_size(self, group_id, chord_size) -> None:
        pass  # the counter row was written with the header's size

    def on_chord_part_return(self, request, state, result, **kwargs) -> None:
        pass  # header jobs count the chord down in their success transaction


class LeaseResult(AsyncResult):
    """What a leased task's ``delay()`` / ``apply_async()`` / ``apply()`` returns: Celery's
    AsyncResult for the job id, plus the job itself."""

    @property
    def job(self) -> Job | None:
        """The job's row now (``leases.get(id)``)."""
        return _leases(self.app).get(self.id)

    def revoke(self, connection=None, terminate=False, signal=None, wait=False, timeout=None) -> None:
        """Cancel the job in its row at once, durably, even with no worker running; with
        ``terminate=True`` also ask the workers to kill the process running it."""
        _leases(self.app).cancel(self.id)
        if terminate:
            super().revoke(connection, terminate=True, signal=signal, wait=wait, timeout=timeout)


def install(app) -> None:
    """Make LeaseBackend the app's result backend if it has none, now and whenever the
    configuration is (re)loaded."""

    def install_if_none(sender=None, **_):
        if app.conf.result_backend in (None, "", "disabled"):
            app.conf.result_backend = BACKEND

    app.on_after_configure.connect(install_if_none, weak=False)
    if app.configured:
        install_if_none()
    app._celery_lease_results = install_if_none
