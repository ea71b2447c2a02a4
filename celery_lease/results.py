"""Celery's result API over the job rows: ``AsyncResult(job.id).state`` and ``.get()``.

:class:`LeaseBackend` is a Celery result backend that reads a job's row; ``CeleryLease``
installs it when the app has no ``result_backend``, so ``AsyncResult``, chains' and
groups' results and chords work with no other setting. An app with its own backend keeps
it for plain tasks; leased tasks still answer through this one, and the app's backend
answers for job ids from their rows too (:class:`RowFallback`). States come from the row
(docs/coming-from-celery.md): PENDING (also an unknown id), RETRY, STARTED (``.result``:
the progress), SUCCESS, FAILURE (``.get()`` raises ``JobFailed(stored error)``), REVOKED
(``.get()`` raises ``TaskRevokedError``). Plain tasks' results are not stored by this
backend (as with no backend at all): give the app a result backend of its own for those.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

from celery import states
from celery.app import backends
from celery.backends.base import BaseBackend
from celery.exceptions import TimeoutError as CeleryTimeoutError
from celery.result import AsyncResult, ResultSet

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


class RowFallback:
    """Mixed into an app's own result backend (:func:`install`): a task id the backend
    knows nothing of (PENDING) that is a job id answers from the job's row, wherever
    Celery asks: ``app.AsyncResult(id)``, ``celery.result.AsyncResult(id)``, their
    ``.get()``, and a group's ``join_native()`` / ``.get()`` with leased members (which
    the backend's own native join would wait for forever: it never stores them)."""

    app: Any

    def _job_meta(self, task_id: str) -> dict[str, Any] | None:
        try:
            job_id = parse_job_id(task_id)
        except ValueError:
            return None
        job = _leases(self.app).get(job_id)
        return None if job is None else meta_of(task_id, job)

    def _get_task_meta_for(self, task_id):
        meta = super()._get_task_meta_for(task_id)  # type: ignore[misc]
        if meta.get("status") == states.PENDING:
            return self._job_meta(task_id) or meta
        return meta

    def _wait_for_row(self, task_id: str, timeout=None, interval: float = 0.5, on_interval=None) -> dict[str, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            meta = self._job_meta(task_id) or meta_of(task_id, None)
            if meta["status"] in states.READY_STATES:
                return meta
            if on_interval is not None:
                on_interval()
            if deadline is not None and time.monotonic() >= deadline:
                raise CeleryTimeoutError("The operation timed out.")
            time.sleep(interval)

    def wait_for_pending(self, result, timeout=None, interval=0.5, on_interval=None, callback=None, propagate=True, **kwargs):
        if self._job_meta(result.id) is None:
            return super().wait_for_pending(  # type: ignore[misc]
                result,
                timeout=timeout,
                interval=interval,
                on_interval=on_interval,
                callback=callback,
                propagate=propagate,
                **kwargs,
            )
        result._maybe_set_cache(self._wait_for_row(result.id, timeout, interval, on_interval))
        return result.maybe_throw(propagate=propagate, callback=callback)

    def iter_native(self, result, timeout=None, interval=0.5, on_interval=None, **kwargs):
        leased = [r.id for r in result.results if isinstance(r, LeaseResult)]
        others = [r for r in result.results if not isinstance(r, LeaseResult)]
        native = super().iter_native  # type: ignore[misc]
        if not leased:
            yield from native(result, timeout=timeout, interval=interval, on_interval=on_interval, **kwargs)
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        if others:
            yield from native(
                ResultSet(others, app=self.app), timeout=timeout, interval=interval, on_interval=on_interval, **kwargs
            )
        for task_id in leased:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            yield task_id, self._wait_for_row(task_id, left, interval, on_interval)

    def apply_chord(self, header_result_args, body, **kwargs):
        """A chord whose header is leased counts down in celery-lease's counter row (as
        with LeaseBackend): this backend never sees those members' results."""
        group_id, members = header_result_args[0], list(header_result_args[1])
        leased = [r for r in members if isinstance(r, LeaseResult)]
        if not leased:
            return super().apply_chord(header_result_args, body, **kwargs)  # type: ignore[misc]
        if len(leased) != len(members):
            raise TypeError("a chord's header must be all leased tasks or all plain ones (put the plain ones in a chain)")
        _leases(self.app).canvas.create_chord(group_id, [r.id for r in leased], body)


_WITH_ROWS: dict[type, type] = {}


def _with_rows(cls: type) -> type:
    """``cls`` with :class:`RowFallback` in front (one class per backend class)."""
    if issubclass(cls, (LeaseBackend, RowFallback)):
        return cls
    if cls not in _WITH_ROWS:
        _WITH_ROWS[cls] = type(cls.__name__, (RowFallback, cls), {"__module__": cls.__module__})
    return _WITH_ROWS[cls]


def install(app) -> None:
    """Make LeaseBackend the app's result backend if it has none, now and whenever the
    configuration is (re)loaded; an app's own backend answers for jobs too (RowFallback)."""

    def backend_with_rows():
        # Celery's own Celery._get_backend, with the backend class given RowFallback.
        cls, url = backends.by_url(app.backend_cls or app.conf.result_backend, app.loader)
        return _with_rows(cls)(app=app, url=url)

    app._get_backend = backend_with_rows

    def install_if_none(sender=None, **_):
        if app.conf.result_backend in (None, "", "disabled"):
            app.conf.result_backend = BACKEND

    app.on_after_configure.connect(install_if_none, weak=False)
    if app.configured:
        install_if_none()
    app._celery_lease_results = install_if_none
