"""LeaseTask: the Celery task behind every ``@leases.job`` handler.

Producer side, its ``submit`` writes the job row and publishes a wakeup whose task id
is the job id; ``delay`` and ``apply_async`` are routed through ``submit``. Worker side,
its body runs the handler of the attempt that ``task_prerun`` claimed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from celery import Task

from celery_lease.job import Job
from celery_lease.kinds import JobKind

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

    from celery_lease.producer import Producer
    from celery_lease.worker.executor import WorkerState


class LeaseTask(Task):
    #: Results live in the job row; Celery's result backend is not used.
    ignore_result = True
    #: Early ack is safe here: the message is only a wakeup. A worker killed mid-job
    #: leaves the row running under a lease, which the reaper requeues; acks_late would
    #: instead re-deliver the message after the visibility timeout for nothing.
    acks_late = False
    typing = False

    # Set per handler by CeleryLease.job():
    spec: JobKind
    #: The CeleryLease this task belongs to (signals are process-global: they check it).
    owner: object
    #: This process's producer and worker side, made on first use (after fork).
    producer: Callable[[], Producer]
    worker_state: Callable[[], WorkerState]

    @property
    def kind(self) -> str:
        return self.spec.kind

    @property
    def codec(self):
        return self.spec.codec

    @property
    def max_attempts(self) -> int:
        return self.spec.max_attempts

    @property
    def lease_seconds(self) -> int:
        return self.spec.lease_seconds

    def submit(
        self,
        payload: Any,
        *,
        idempotency_key: str | None = None,
        connection: Connection | None = None,
        run_after: datetime | timedelta | float | None = None,
        run_id: str | None = None,
        tenant: str | None = None,
        queue: str | None = None,
        priority: int = 0,
    ) -> Job:
        """Store a new pending job and wake a worker for it.

        With ``connection``, the row is written in the caller's transaction and the
        wakeup is published only after that transaction commits; a rollback leaves
        neither. With ``idempotency_key``, a second submit of the same kind and key
        returns the first job and stores nothing. A higher ``priority`` (0, the
        default, is the lowest) is claimed first among due jobs of the kind.
        """
        return self.producer().submit_many(
            self.spec,
            [payload],
            idempotency_keys=None if idempotency_key is None else [idempotency_key],
            connection=connection,
            run_after=run_after,
            run_id=run_id,
            tenant=tenant,
            queue=queue,
            priority=priority,
        )[0]

    def submit_many(
        self,
        payloads: Iterable[Any],
        *,
        idempotency_keys: Iterable[str] | None = None,
        connection: Connection | None = None,
        run_after: datetime | timedelta | float | None = None,
        run_id: str | None = None,
        tenant: str | None = None,
        queue: str | None = None,
        priority: int = 0,
    ) -> list[Job]:
        """Store many jobs with one multi-row INSERT and pipeline their wakeups."""
        return self.producer().submit_many(
            self.spec,
            payloads,
            idempotency_keys=idempotency_keys,
            connection=connection,
            run_after=run_after,
            run_id=run_id,
            tenant=tenant,
            queue=queue,
            priority=priority,
        )

    # Plain Celery calls are the same as submit: a leased job never bypasses its row.
    def delay(self, payload: Any, **options) -> Job:
        return self.submit(payload, **options)

    def apply_async(self, args=None, kwargs=None, *, countdown=None, eta=None, queue=None, **options) -> Job:
        args = tuple(args or ())
        kwargs = dict(kwargs or {})
        if "payload" in kwargs:
            args = (kwargs.pop("payload"), *args)
        if len(args) != 1 or kwargs:
            raise TypeError(f"{self.name}.apply_async takes exactly one payload argument")
        unsupported = set(options) - {
            "idempotency_key",
            "connection",
            "run_id",
            "tenant",
            "priority",
            "task_id",
            "expires",
            "retry",
            "retry_policy",
        }
        if unsupported:
            raise TypeError(f"{self.name}.apply_async: unsupported options {sorted(unsupported)}")
        if options.pop("task_id", None) is not None:
            raise TypeError("a leased job's task id is its job id, chosen at submit")
        for ignored in ("expires", "retry", "retry_policy"):
            options.pop(ignored, None)
        run_after = eta if eta is not None else countdown
        return self.submit(args[0], run_after=run_after, queue=queue, **options)

    # --- worker side -------------------------------------------------------------------

    def emit_progress(self, progress: Any) -> None:
        """Send progress as a Celery event so Flower's event stream carries it."""
        if self.app.conf.worker_send_task_events:
            self.send_event("task-progress", progress=progress)


def run_leased(self: LeaseTask) -> Any:
    """The body of every LeaseTask: run the attempt task_prerun claimed, if any."""
    attempt = getattr(self.request, "lease_attempt", None)
    if attempt is None:
        return None  # duplicate, terminal or not-yet-due delivery: acknowledged, no body
    return self.worker_state().execute(self.spec, attempt, self.emit_progress)
