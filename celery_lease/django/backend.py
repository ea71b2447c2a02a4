"""A backend for Django's tasks framework whose tasks are durable leased jobs.

``TASKS = {"default": {"BACKEND": "celery_lease.django.LeaseTaskBackend", "QUEUES": [...],
"OPTIONS": {...}}}`` registers one job kind on the project's CeleryLease (``django_task``
for the ``default`` alias, ``django_task_<alias>`` otherwise, or ``OPTIONS["KIND"]``)
whose payload names the task and its arguments; ``enqueue`` inside
``transaction.atomic()`` joins that transaction (:mod:`celery_lease.django.transaction`).
Statuses map as in ``_STATUS`` (pending, also between retries, is READY). A task that
raises is retried with backoff while attempts remain, then FAILED with ``"internal error:
<exception type> (ref <r>)"``; its text and traceback go to the worker log only. OPTIONS:
``APP`` (default: Celery's current app), ``KIND``, ``MAX_ATTEMPTS`` (3; 1 is Django's
no-retry), ``LEASE_SECONDS``, ``TIMEOUT`` (seconds per attempt).
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from celery_lease import JobContext
from celery_lease.errors import Failure
from celery_lease.extension import CeleryLease
from celery_lease.job import Job
from celery_lease.status import Status

try:  # Django >= 6.0
    from django.tasks import TaskContext, TaskResult, TaskResultStatus, task_backends
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import Task, TaskError
    from django.tasks.exceptions import TaskResultDoesNotExist
except ImportError:  # older Django: the django-tasks backport, the same API
    from django_tasks import TaskContext, TaskResult, TaskResultStatus, task_backends
    from django_tasks.backends.base import BaseTaskBackend
    from django_tasks.base import Task, TaskError
    from django_tasks.exceptions import TaskResultDoesNotExist

__all__ = ["LeaseTaskBackend", "task_backends"]

_STATUS = {
    Status.PENDING: TaskResultStatus.READY,
    Status.RUNNING: TaskResultStatus.RUNNING,
    Status.SUCCEEDED: TaskResultStatus.SUCCESSFUL,
    Status.FAILED: TaskResultStatus.FAILED,
    Status.EXPIRED: TaskResultStatus.FAILED,
    Status.CANCELLED: TaskResultStatus.FAILED,
}
#: Django's task priorities are -100..100; job priorities 0..255.
PRIORITY_OFFSET = 100
#: Django's queue that means "Celery's default routing" (no queue= on the wakeup).
DEFAULT_QUEUE = "default"


class LeaseTaskBackend(BaseTaskBackend):
    supports_defer = True
    supports_async_task = True  # Task.call runs a coroutine function to completion
    supports_get_result = True
    supports_priority = True

    def __init__(self, alias: str, params: dict) -> None:
        super().__init__(alias, params)
        options = {key.upper(): value for key, value in self.options.items()}
        self.leases = _leases_of(options.get("APP"))
        self.kind: str = options.get("KIND") or ("django_task" if alias == "default" else f"django_task_{alias}")
        if self.kind not in self.leases.kinds:
            self.leases.job(
                kind=self.kind,
                name=f"celery_lease.django.{self.kind}",
                max_attempts=int(options.get("MAX_ATTEMPTS", 3)),
                lease_seconds=int(options.get("LEASE_SECONDS", 60)),
                timeout=options.get("TIMEOUT"),
            )(_run_task)

    def enqueue(self, task: Task, args: Any, kwargs: Any) -> TaskResult:
        self.validate_task(task)
        payload = {"task": task.module_path, "args": list(args), "kwargs": dict(kwargs)}
        job = self.leases.submit(
            self.kind,
            payload,
            queue=None if task.queue_name == DEFAULT_QUEUE else task.queue_name,
            priority=task.priority + PRIORITY_OFFSET,
            run_after=task.run_after,
        )
        return self._result(task, job)

    def get_result(self, result_id: str) -> TaskResult:
        try:
            job = self.leases.get(result_id)
        except ValueError:  # not a job id at all
            job = None
        if job is None or job.kind != self.kind:
            raise TaskResultDoesNotExist(result_id)
        try:
            task = _task_at(job.payload["task"])
        except Failure:
            raise TaskResultDoesNotExist(result_id) from None
        return self._result(task, job)

    def _result(self, task: Task, job: Job) -> TaskResult:
        status = _STATUS[job.status]
        errors = []
        if status == TaskResultStatus.FAILED:
            errors.append(
                TaskError(exception_class_path="celery_lease.errors.JobFailed", traceback=job.error or job.status.value)
            )
        result = TaskResult(
            task=task,
            id=job.id,
            status=status,
            enqueued_at=job.created_at,
            started_at=job.started_at,
            finished_at=job.finished_at,
            last_attempted_at=job.started_at,
            args=job.payload.get("args", []),
            kwargs=job.payload.get("kwargs", {}),
            backend=self.alias,
            errors=errors,
            # One entry per attempt; the row keeps only the last attempt's worker.
            worker_ids=[job.lease_owner or ""] * job.attempt,
        )
        if status == TaskResultStatus.SUCCESSFUL:
            object.__setattr__(result, "_return_value", job.result)  # TaskResult is frozen; Django's backends do the same
        return result


def _leases_of(app_path: str | None) -> CeleryLease:
    if app_path:
        app = import_string(app_path)
    else:
        from celery import current_app

        app = current_app._get_current_object()
    leases = getattr(app, "lease", None)
    if not isinstance(leases, CeleryLease):
        raise ImproperlyConfigured(
            f"celery_lease.django.LeaseTaskBackend: the Celery app {app.main!r} has no CeleryLease "
            "(create CeleryLease(app) in the project's celery.py, or name the app in OPTIONS['APP'])"
        )
    return leases


def _task_at(path: Any) -> Task:
    """The Django task a job's payload names; Failure (no retry: it cannot improve) when
    the path names none."""
    try:
        task = import_string(path) if isinstance(path, str) else None
    except ImportError:
        task = None
    if not isinstance(task, Task):
        raise Failure("the job names no Django task (was it renamed or removed?)")
    return task


def _run_task(ctx: JobContext, payload: dict) -> Any:
    """The handler of a backend's kind, in the worker: call the task the payload names."""
    task = _task_at(payload.get("task"))
    args, kwargs = payload.get("args", []), payload.get("kwargs", {})
    if task.takes_context:
        context = TaskContext(task_result=task.get_backend().get_result(ctx.job_id))
        return task.call(context, *args, **kwargs)
    return task.call(*args, **kwargs)
