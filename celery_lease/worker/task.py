"""LeaseTask: the Celery task behind every ``@leases.job`` handler.

Producer side, ``submit`` writes the job row and publishes a wakeup whose task id is the
job id; Celery's ``delay`` / ``apply_async`` / signatures go through the same path and
return a :class:`~celery_lease.results.LeaseResult` (an AsyncResult reading the row).
Eager mode (``task_always_eager``), ``apply()`` and a direct call run the job in this
process (:mod:`celery_lease.worker.eager`). Worker side, the body runs the attempt that
``task_prerun`` claimed. Celery options that cannot mean anything for a leased job are
refused when the signature or call is made, with what to use instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from celery import Task
from celery.exceptions import Ignore

from celery_lease import grouping, tracing
from celery_lease.errors import JobRefused
from celery_lease.job import Job, parse_job_id
from celery_lease.kinds import JobKind
from celery_lease.results import LeaseBackend, LeaseResult, RowFallback
from celery_lease.status import Status
from celery_lease.worker import events
from celery_lease.worker.outcome import Outcome

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

    from celery_lease.canvas import Canvas
    from celery_lease.producer import Producer
    from celery_lease.worker.eager import EagerRunner
    from celery_lease.worker.executor import WorkerState

#: Celery options with no effect on a leased job (the wakeup carries no arguments, the
#: row is the result): accepted and dropped.
IGNORED_OPTIONS = frozenset(
    {
        "expires",
        "retry",
        "retry_policy",
        "producer",
        "publisher",
        "add_to_parent",
        "reply_to",
        "serializer",
        "compression",
        "headers",
        "router",
        "result_cls",
        "ignore_result",
        "stamped_headers",
        "stamps",
        "shadow",
        "kwargsrepr",
        "replaced_task_nesting",
        "route_name",
        "task_type",
    }
)
#: Options honoured (see canvas.py for the canvas ones).
KNOWN_OPTIONS = frozenset(
    {
        "idempotency_key",
        "connection",
        "run_id",
        "tenant",
        "run_after",
        "countdown",
        "eta",
        "queue",
        "task_id",
        "priority",
        "link",
        "link_error",
        "chain",
        "chord",
        "group_id",
        "group_index",
        "root_id",
        "parent_id",
        "argsrepr",
    }
)
#: Refused, with what to use instead.
REFUSED_OPTIONS = {
    "time_limit": "per-call time limits do not apply to leased jobs: use lease_seconds and ctx.raise_if_cancelled(), "
    "or the worker's --time-limit",
    "soft_time_limit": "per-call time limits do not apply to leased jobs: use lease_seconds and ctx.raise_if_cancelled(), "
    "or the worker's --soft-time-limit",
    "exchange": "leased jobs are routed by queue: pass queue= (or @leases.job(queue=...))",
    "routing_key": "leased jobs are routed by queue: pass queue= (or @leases.job(queue=...))",
}


def check_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """The options a leased job keeps; raises TypeError for one it cannot honour."""
    for key in options:
        if key in REFUSED_OPTIONS:
            raise TypeError(f"{name}: {key}= is not supported: {REFUSED_OPTIONS[key]}")
        if key not in KNOWN_OPTIONS and key not in IGNORED_OPTIONS:
            raise TypeError(f"{name}: unsupported option {key!r}")
    priority = options.get("priority")
    if priority is not None and (not isinstance(priority, int) or isinstance(priority, bool) or not 0 <= priority <= 255):
        raise TypeError(f"{name}: priority must be an integer from 0 to 255")
    return {k: v for k, v in options.items() if k in KNOWN_OPTIONS and v is not None}


def one_payload(name: str, args: Any, kwargs: Any) -> Any:
    args = tuple(args or ())
    kwargs = dict(kwargs or {})
    if "payload" in kwargs:
        args = (kwargs.pop("payload"), *args)
    if len(args) != 1 or kwargs:
        raise TypeError(f"{name} takes exactly one payload argument (a leased job's input is one JSON value)")
    return args[0]


class LeaseTask(Task):
    #: Results live in the job row; Celery's result backend is not written.
    ignore_result = True
    #: Early ack is safe here: the message is only a wakeup. A worker killed mid-job
    #: leaves the row running under a lease, which the reaper requeues; acks_late would
    #: instead re-deliver the message after the visibility timeout for nothing.
    acks_late = False
    typing = False
    #: Expected outcomes: Celery logs them at INFO without a traceback (a Failure is the
    #: handler's decision, not a crash for Sentry). Spent retries stay JobFailed: ERROR.
    throws = (JobRefused,)

    # Set per handler by CeleryLease.job():
    spec: JobKind
    #: The CeleryLease this task belongs to (signals are process-global: they check it).
    owner: Any
    #: This process's producer, worker side and eager runner, made on first use (after fork).
    producer: Callable[[], Producer]
    worker_state: Callable[[], WorkerState]
    eager_runner: Callable[[], EagerRunner]
    canvas: Canvas

    _lease_backend: LeaseBackend | None = None

    @property
    def kind(self) -> str:
        return self.spec.kind

    @property
    def queue(self) -> str | None:
        # The kind's own queue, which Celery's router reads from the task (a plain
        # send_task of it goes there too). A property: a queue set as a class attribute
        # makes Celery warn "The 'queue' task attribute is deprecated" at every bind.
        return self.spec.queue

    @property
    def codec(self):
        return self.spec.codec

    @property
    def max_attempts(self) -> int:
        return self.spec.max_attempts

    @property
    def lease_seconds(self) -> int:
        return self.spec.lease_seconds

    # --- results ---------------------------------------------------------------------

    @property
    def backend(self) -> LeaseBackend:
        """The app's backend when it is celery-lease's, else one of our own: a leased
        job's result is its row, whatever backend the app's plain tasks use."""
        app_backend = self.app.backend
        if isinstance(app_backend, LeaseBackend):
            return app_backend
        if self._lease_backend is None:
            self._lease_backend = LeaseBackend(app=self.app)
        return self._lease_backend

    @backend.setter
    def backend(self, value) -> None:
        pass  # Celery assigns the app's backend to tasks; ours is chosen above

    def AsyncResult(self, task_id: str, **kwargs: Any) -> LeaseResult:
        return LeaseResult(task_id, backend=self.backend, task_name=self.name, app=self.app, **kwargs)

    # --- submit ----------------------------------------------------------------------

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
        priority: int | None = None,
    ) -> Job:
        """Store a new pending job and wake a worker for it.

        With ``connection``, the row is written in the caller's transaction and the
        wakeup is published only after that transaction commits; a rollback leaves
        neither. With ``idempotency_key``, a second submit of the same kind and key
        returns the first job and stores nothing. ``job.get(timeout)`` waits for it.
        A higher ``priority`` (0, the default, is the lowest; up to 255) is claimed
        first among due jobs of the kind (docs/flow-control.md).
        """
        return self.submit_many(
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
        priority: int | None = None,
    ) -> list[Job]:
        """Store many jobs with one multi-row INSERT and pipeline their wakeups."""
        canvas = None if priority is None else self.canvas.pack(check_options(self.name, {"priority": priority}))
        jobs = self.producer().submit_many(
            self.spec,
            payloads,
            idempotency_keys=idempotency_keys,
            connection=connection,
            run_after=run_after,
            run_id=run_id,
            tenant=tenant,
            queue=queue,
            priority=priority,
            canvas=canvas,
        )
        return [job.bind(self.owner) for job in jobs]

    # --- Celery's calling API ----------------------------------------------------------

    def _submit_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """Producer options from Celery's (already checked) apply_async options."""
        options = dict(options)
        task_id = options.pop("task_id", None)
        key = options.pop("idempotency_key", None)
        if task_id is not None:
            try:
                task_id = parse_job_id(task_id)
            except ValueError:
                raise TypeError(f"{self.name}: a leased job's task id is its job id and must be a UUID") from None
            # The same frozen task id applied twice (a redelivered plain step) is one job.
            key = key if key is not None else f"celery:{task_id}"
        connection = options.pop("connection", None)
        if connection is not None and not hasattr(connection, "execute"):
            connection = None  # a kombu connection (Celery's legacy option), not a transaction
        eta, countdown = options.pop("eta", None), options.pop("countdown", None)
        run_after = options.pop("run_after", None)
        if run_after is None:
            run_after = eta if eta is not None else countdown
        submit = {
            "idempotency_keys": None if key is None else [key],
            "connection": connection,
            "run_after": run_after,
            "run_id": options.pop("run_id", None),
            "tenant": options.pop("tenant", None),
            "queue": options.pop("queue", None),
            "job_id": task_id,
            # Flow control orders claims by it; canvas.pack keeps Celery's copy too.
            "priority": options.get("priority"),
        }
        if options.get("chord") is not None and not isinstance(self.app.backend, (LeaseBackend, RowFallback)):
            raise TypeError(
                f"{self.name}: chords of leased tasks need celery-lease's counter rows: LeaseBackend, or the app's "
                "own backend as CeleryLease(app) wraps it; this app's backend was replaced after CeleryLease(app) "
                "(docs/converting.md#chords has the workaround)"
            )
        submit["canvas"] = self.canvas.pack(options)
        return submit

    def _result(self, job: Job) -> LeaseResult:
        return self.AsyncResult(job.id)

    def delay(self, *args: Any, **kwargs: Any) -> LeaseResult:
        return self.apply_async(args, kwargs)

    def apply_async(self, args=None, kwargs=None, **options: Any) -> LeaseResult:
        """Celery's call: submits the job (or runs it here in eager mode)."""
        payload = one_payload(self.name, args, kwargs)
        group_submit = grouping.group_submit_for(options)  # a member of a group being applied
        options = check_options(self.name, options)
        if self.app.conf.task_always_eager:
            return self.apply((payload,), **options)
        submit = self._submit_options(options)
        if group_submit is not None:  # written with the other members when the group is applied
            group_submit.add(self.producer(), self.spec, payload, submit)
            return self.AsyncResult(submit["job_id"])
        job = self.producer().submit_many(self.spec, [payload], **submit)[0]
        return self._result(job)

    def apply(self, args=None, kwargs=None, **options: Any) -> LeaseResult:
        """Run the job in this process to a terminal status (its row is written to the
        configured database; nothing goes to the broker)."""
        payload = one_payload(self.name, args, kwargs)
        submit = self._submit_options(check_options(self.name, options))
        submit.pop("connection", None)  # it runs now: its row must be committed first
        return self._result(self.eager_runner().run(self.spec, payload, **submit))

    def signature(self, args=None, *starargs: Any, **starkwargs: Any):
        sig = super().signature(args, *starargs, **starkwargs)
        check_options(self.name, dict(sig.options))
        count = len(sig.args) + len(sig.kwargs)
        if count > 1 or (sig.kwargs and set(sig.kwargs) != {"payload"}):
            raise TypeError(
                f"{self.name}.s()/.si() take one payload: {self.kind}.si(payload) for a fixed payload, "
                f"{self.kind}.s() to receive the previous step's result"
            )
        if sig.immutable and count == 0:
            raise TypeError(f"{self.name}.si() needs the payload: {self.kind}.si(payload)")
        return sig

    subtask = signature

    def _no_map_or_chunks(self, *_: Any, **__: Any):
        raise TypeError(
            f"{self.name}: map/starmap/chunks call the handler with plain arguments inside another task; "
            f"use {self.kind}.submit_many(payloads) or group({self.kind}.s(p) for p in payloads)"
        )

    map = starmap = chunks = _no_map_or_chunks

    # --- worker side -------------------------------------------------------------------

    def emit_progress(self, progress: Any) -> None:
        """Send progress as a Celery event so Flower's event stream carries it."""
        if events.enabled(self):
            self.send_event("task-progress", progress=progress)


def run_leased(self: LeaseTask, *args: Any, **kwargs: Any) -> Any:
    """The body of every LeaseTask.

    Called directly (``task(payload)``): runs the job here and returns the terminal Job.
    In a worker: runs the attempt task_prerun claimed. A delivery that claimed nothing
    (duplicate, not due, terminal) and an attempt that ended without recording success
    (cancelled, lease lost, handed off on shutdown) end in Celery's ``Ignore``, so no
    task-succeeded event tells Flower otherwise; a cancelled job is announced as revoked.
    """
    if self.request.called_directly:
        return self.eager_runner().run(self.spec, one_payload(self.name, args, kwargs)).bind(self.owner)
    attempt = getattr(self.request, "lease_attempt", None)
    if attempt is None:
        _announce_skipped(self)
        raise Ignore()
    events.attempt_started(self, attempt)
    with tracing.current(attempt):  # the handler's spans and the jobs it creates are the attempt's
        if attempt.claimed_together is not None:  # each other job of a many-job claim is a task to Celery's tools too
            value = self.worker_state().many_claims.run(self.spec, attempt, self.emit_progress, events.ManyClaimTasks.of(self))
        else:
            value = self.worker_state().execute(self.spec, attempt, self.emit_progress)
    if attempt.outcome is not Outcome.SUCCEEDED:
        _announce_skipped(self)
        raise Ignore()
    return value


def _announce_skipped(task: LeaseTask) -> None:
    """Tell Flower why a delivery ran nothing: cancelled, or pending (held, not yet due)."""
    if not events.enabled(task):
        return
    try:
        job = task.owner.get(task.request.id)
    except ValueError:
        return
    if job is not None and job.status is Status.CANCELLED:
        events.revoked(task)
    elif job is not None and job.status is Status.PENDING:
        events.held(task)
