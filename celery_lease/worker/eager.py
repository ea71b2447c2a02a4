"""Eager mode: run leased jobs in this process, start to finish, with no broker.

``task_always_eager=True`` (how most Celery shops unit-test), ``task.apply(...)`` and a
direct call ``task(payload)`` come here. The job gets its row in the configured database
(SQLite is fine), then this process claims it and runs the handler exactly as a worker
would: the same claim, fenced writes, checkpoints, effects, ``Failure`` and retries. A
retry runs at once (Celery's eager mode ignores countdowns too), so the call returns the
job in a terminal status. Children and chain steps the job creates run here as well, in
order, after it; plain follow-up tasks are applied in-process with ``apply()``. Nothing
is published to the broker. One thread at a time per process.
"""

from __future__ import annotations

import socket
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from celery import Celery
from celery.exceptions import Retry

from celery_lease import tracing
from celery_lease.errors import ConfigurationError, JobFailed
from celery_lease.producer import Producer
from celery_lease.worker.executor import WorkerState
from celery_lease.worker.outcome import Outcome

if TYPE_CHECKING:
    from celery_lease.canvas import Canvas
    from celery_lease.db.store import Store
    from celery_lease.job import Job
    from celery_lease.kinds import JobKind, Registry
    from celery_lease.settings import Settings

#: A job that keeps coming back (snoozes, hand-offs) stops being run here after this.
MAX_ATTEMPT_ROUNDS = 1000


class _LocalProducer(Producer):
    """A producer whose wakeups are kept for this process instead of published."""

    def __init__(self, app: Celery, store: Store, settings: Settings) -> None:
        super().__init__(app, store, settings)
        self.woken: list[str] = []

    def publish_wakeups(self, jobs: Sequence[Job | dict], *, coalesce: bool = False) -> int:
        self.woken.extend(str(j["id"]) if isinstance(j, dict) else j.id for j in jobs)
        return len(jobs)


class EagerRunner:
    def __init__(self, app: Celery, store: Store, registry: Registry, settings: Settings, canvas: Canvas) -> None:
        self._store = store
        self._registry = registry
        self.producer = _LocalProducer(app, store, settings)
        # No broker URL: no cancel-notice listener; the heartbeat still renews leases.
        self._worker = WorkerState(store, self.producer, registry, settings, None, canvas=canvas, eager=True)
        self._hostname = f"eager@{socket.gethostname()}"

    def run(self, spec: JobKind, payload: Any, **submit: Any) -> Job:
        """Submit one job (no wakeup) and run it, and what it sets off, to the end."""
        job = self.producer.submit_many(spec, [payload], wake=False, **submit)[0]
        self.drain([job.id])
        done = self._store.get(job.id)
        if done is None:
            # Written in a transaction the runner's own connection cannot see.
            raise ConfigurationError(
                "eager mode cannot run a job submitted inside a transaction that is not committed (Django's atomic(), "
                "or a test case that wraps each test in one: Django's TestCase, pytest-django's django_db): use a "
                "transactional test (TransactionTestCase, django_db(transaction=True)) or submit outside the block"
            )
        return done

    def drain(self, job_ids: list[str]) -> None:
        queue = deque(job_ids)
        while queue:
            self._run_to_end(queue.popleft())
            queue.extend(self.producer.woken)
            self.producer.woken.clear()

    def _run_to_end(self, job_id: str) -> None:
        for _ in range(MAX_ATTEMPT_ROUNDS):
            job = self._store.get(job_id)
            if job is None or job.terminal:
                return
            self._store.make_due(job_id)  # a retry's backoff or run_after: now
            spec = self._registry.resolve(job.kind)
            started = tracing.clock()
            attempt = self._worker.begin(job_id, spec, self._hostname)
            if attempt is None:
                return  # running elsewhere: not ours to finish
            if started is not None:
                tracing.start_attempt(attempt, job.queue, started, None)
            try:
                with tracing.current(attempt):
                    self._worker.execute(spec, attempt)
            except (Retry, JobFailed):
                pass  # recorded: the loop reads the row again
            finally:
                tracing.end_attempt(attempt)
                self._worker.end(attempt)
                self._worker.flush()
            if attempt.outcome in (None, Outcome.CANCELLED):
                return
