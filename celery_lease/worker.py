"""The lease life inside a worker process: claim, heartbeat, run the body, complete.

The Celery signals in :mod:`celery_lease.signals` call these at their moments:
``task_prerun`` -> :meth:`WorkerState.begin`, the task body -> :meth:`WorkerState.execute`,
``task_postrun`` -> :meth:`WorkerState.end`.
"""

from __future__ import annotations

import logging
import os
import queue
import random
import socket
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

from celery.exceptions import Retry

from . import notify
from . import queries as q
from .context import SHUTDOWN, Attempt, JobContext
from .errors import DatabaseUnavailable, Failure, JobCancelled, JobFailed, JobSuspended, LeaseLost
from .payload import cap_error
from .status import Event

if TYPE_CHECKING:
    from .extension import CeleryLease
    from .task import LeaseTask

log = logging.getLogger("celery_lease.worker")

#: Identifies this boot of the worker. Set at import in the worker's main process and
#: inherited by its pool children, so restart recovery can tell "running under this
#: node name from an earlier boot" (interrupted) from "running here now".
BOOT_ID = uuid.uuid4().hex[:12]

#: The stored error of any exception that is not a Failure. Its text and traceback go
#: to the log with the job id, never to the table: a dependency's message may carry a
#: secret (a DSN, a token, a row of customer data).
INTERNAL_ERROR = "internal error"


def owner_of(node: str | None) -> str:
    return f"{node or socket.gethostname()}/{os.getpid()}/{BOOT_ID}"


class Heartbeat:
    """Renews every lease held by this process in one statement per interval.

    One daemon thread per process. The interval is a third of the shortest lease
    held. A renewal that fails on a database error is retried every second; an attempt
    whose lease would expire before a renewal lands is marked lost, so its handler
    stops writing before another attempt can be claimed.
    """

    RETRY_SECONDS = 1.0

    def __init__(self, leases: "CeleryLease") -> None:
        self._leases = leases
        self._attempts: dict[str, Attempt] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = 0
        #: Seconds the last renewal statement took (for metrics).
        self.last_latency = 0.0

    def add(self, attempt: Attempt) -> None:
        with self._lock:
            self._attempts[attempt.job_id] = attempt
            if self._thread is None or self._pid != os.getpid():
                self._pid = os.getpid()
                self._thread = threading.Thread(target=self._loop, name="celery-lease-heartbeat", daemon=True)
                self._thread.start()
                notify.listen(self._leases, self.wake)  # sooner than the next renewal

    def remove(self, attempt: Attempt) -> None:
        with self._lock:
            if self._attempts.get(attempt.job_id) is attempt:
                del self._attempts[attempt.job_id]

    def wake(self) -> None:
        """Renew now, e.g. when told by a message that a job may have been cancelled."""
        self._wake.set()

    def renew_now(self, attempt: Attempt) -> bool:
        self._renew([attempt])
        return not attempt.lost.is_set()

    def _interval(self) -> float:
        with self._lock:
            leases = [a.lease_seconds for a in self._attempts.values()]
        return min(leases) / 3 if leases else 1.0

    def _loop(self) -> None:
        delay = self._interval()
        while True:
            self._wake.wait(delay)
            self._wake.clear()
            with self._lock:
                attempts = [a for a in self._attempts.values() if not a.lost.is_set()]
            ok = self._renew(attempts) if attempts else True
            delay = self._interval() if ok else self.RETRY_SECONDS

    def _renew(self, attempts: list[Attempt]) -> bool:
        started = time.monotonic()
        try:
            held = self._leases.store.renew([(a.job_id, a.generation) for a in attempts])
        except Exception:
            log.warning("celery-lease: heartbeat failed; retrying within the lease", exc_info=True)
            now = time.monotonic()
            for a in attempts:
                # Give up while a margin remains: past it the reaper may already have
                # handed the job to another attempt.
                if now - a.renewed_at > a.lease_seconds * 0.8:
                    log.warning("celery-lease: job %s: heartbeat gave up; lease lost", a.job_id)
                    a.lost.set()
            return False
        now = time.monotonic()
        self.last_latency = now - started
        for a in attempts:
            if a.job_id in held:
                a.renewed_at = now
                continue
            a.lost.set()
            with self._lock:
                still_running = self._attempts.get(a.job_id) is a
            # An attempt that completed while the statement ran simply had nothing left
            # to renew; only a running one has really lost its lease.
            if still_running:
                log.warning("celery-lease: job %s: lease lost (cancelled or reaped)", a.job_id)
        return True


#: Queued by Completer.flush: write what is gathered now.
_FLUSH = object()


class Completer:
    """Writes this process's plain successes in batches: one statement per batch.

    A success with nothing else to commit (no effects, children or run events) does
    not need the handler to wait: the attempt's outcome is final once the body has
    returned, and its write stays fenced by the lease generation. So the body returns
    at once and this thread writes every success queued within LINGER seconds in one
    ``complete_jobs`` statement. If the process dies before the write, the job is still
    running under its lease and the reaper requeues it, exactly as if it had died a
    moment earlier inside the body. Warm exits flush (signals.worker_process_shutdown).
    """

    LINGER = 0.002
    MAX_BATCH = 64

    def __init__(self, store) -> None:
        self._store = store
        self._queue: "queue.Queue[tuple[Attempt, Any, Any]]" = queue.Queue()
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._lock = threading.Lock()

    def add(self, attempt: Attempt, result: Any, progress: Any) -> None:
        with self._lock:
            if self._thread is None or self._pid != os.getpid():
                self._pid = os.getpid()
                self._thread = threading.Thread(target=self._loop, name="celery-lease-completer", daemon=True)
                self._thread.start()
        self._queue.put((attempt, result, progress))

    def flush(self, timeout: float = 10.0) -> None:
        """Write every queued success now and wait for it (or give up after timeout)."""
        if self._thread is not None and self._pid == os.getpid():
            self._queue.put(_FLUSH)  # ends the batch being gathered without lingering
            deadline = time.monotonic() + timeout
            while self._queue.unfinished_tasks and time.monotonic() < deadline:
                time.sleep(0.005)

    def _loop(self) -> None:
        while True:
            items = [self._queue.get()]
            deadline = time.monotonic() + self.LINGER
            while len(items) < self.MAX_BATCH and items[-1] is not _FLUSH:
                try:
                    items.append(self._queue.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
            batch = [item for item in items if item is not _FLUSH]
            try:
                if batch:
                    self._write(batch)
            finally:
                for _ in items:
                    self._queue.task_done()

    def _write(self, batch: list[tuple[Attempt, Any, Any]]) -> None:
        params: dict[str, Any] = {}
        for i, (attempt, result, progress) in enumerate(batch):
            params.update({f"job_id_{i}": attempt.job_id, f"generation_{i}": attempt.generation,
                           f"new_result_{i}": result, f"new_progress_{i}": progress})
        try:
            done = self._store.complete_many(params, len(batch))
        except Exception:
            # Left running under their leases: the reaper requeues them.
            log.exception("celery-lease: cannot record %d successes; the reaper will requeue them", len(batch))
            return
        for attempt, _, _ in batch:
            if attempt.job_id not in done:
                log.warning("celery-lease: job %s: lease lost; success discarded", attempt.job_id)


def backoff(attempt: int, base: float, cap: float) -> float:
    """Exponential backoff with jitter: base * 2^(attempt-1), capped, times 0.5..1.5."""
    return min(cap, base * 2 ** max(0, attempt - 1)) * random.uniform(0.5, 1.5)


class WorkerState:
    """Per-process worker side of celery-lease."""

    def __init__(self, leases: "CeleryLease") -> None:
        self.leases = leases
        self.store = leases.store
        self.heartbeat = Heartbeat(leases)
        #: Batches plain successes on PostgreSQL, where each statement is a round trip.
        self.completer = Completer(self.store) if self.store.dialect == "postgresql" else None

    # --- task_prerun / task_postrun ------------------------------------------------

    def begin(self, task: "LeaseTask") -> Attempt | None:
        """Claim the job named by the delivery; None when it is not claimable."""
        job_id = task.request.id
        if SHUTDOWN.value:
            # Warm shutdown: leave the job pending, and since this (early-acked)
            # delivery is spent, wake another worker for it now rather than after the
            # sweeper's staleness threshold.
            queue = (task.request.delivery_info or {}).get("routing_key")
            self.leases.publish_wakeups([{"id": job_id, "task": task.name, "queue": queue}])
            return None
        row = self.store.claim(job_id, owner_of(task.request.hostname))
        if row is None:
            log.info("celery-lease: job %s: duplicate or not claimable delivery; skipped", job_id)
            return None
        attempt = Attempt(
            job_id=job_id,
            generation=row["lease_generation"],
            attempt=row["attempt"],
            max_attempts=row["max_attempts"],
            lease_seconds=row["lease_seconds"],
            run_id=row["run_id"] and str(row["run_id"]),
            parent_id=row["parent_id"] and str(row["parent_id"]),
            tenant=row["tenant"],
            payload=row["payload"],
            checkpoint=row["checkpoint"],
        )
        self.heartbeat.add(attempt)
        return attempt

    def end(self, attempt: Attempt | None) -> None:
        if attempt is not None:
            self.heartbeat.remove(attempt)

    def flush(self) -> None:
        if self.completer is not None:
            self.completer.flush()

    # --- the body --------------------------------------------------------------------

    def execute(self, task: "LeaseTask", attempt: Attempt) -> Any:
        """Run the handler and record its outcome with one fenced statement.

        Returns the stored result. Raises Celery's Retry or JobFailed *after* the
        outcome is recorded, so Flower shows RETRY / FAILURE for the job id; both are
        raised outside any ``except`` block so no traceback of the handler's exception
        (and its text) is chained into Celery's log line or event.
        """
        outcome: tuple[str, Any]
        try:
            # Inside the try: a stored checkpoint over the cap fails this attempt as an
            # internal error (logged with the job id), it does not escape the lease.
            ctx = JobContext(self.leases, task, attempt)
            result = task.fn(ctx, task.codec.load_payload(attempt.payload))
            outcome = ("succeeded", task.codec.dump_result(result))
        except Failure as exc:
            outcome = ("failed", cap_error(exc.message))
        except JobSuspended:
            outcome = ("suspended", None)
        except JobCancelled:
            outcome = ("cancelled", None)
        except Exception:
            log.exception("celery-lease: job %s (%s) attempt %d raised", attempt.job_id, task.kind, attempt.attempt)
            outcome = ("error", None)

        status, value = outcome
        signal: Exception | None = None  # what Celery is told, after the write
        try:
            if status == "succeeded":
                try:
                    return self._succeed(ctx, attempt, value)
                except (LeaseLost, DatabaseUnavailable):
                    raise
                except Exception:
                    # An effect or a child insert raised: the success transaction rolled
                    # back whole, the job still runs under this lease, and the attempt
                    # ends like a handler that raised.
                    log.exception("celery-lease: job %s (%s) attempt %d: success transaction failed",
                                  attempt.job_id, task.kind, attempt.attempt)
                    status = "error"
            if status == "suspended":
                self._hand_off(attempt)
            elif status == "cancelled":
                log.info("celery-lease: job %s: stopped after cancel or lease loss", attempt.job_id)
            elif status == "error" and attempt.attempt < attempt.max_attempts:
                delay = backoff(attempt.attempt, task.retry_backoff, task.retry_backoff_max)
                self._retry(attempt, delay)
                signal = Retry(f"attempt {attempt.attempt} of {attempt.max_attempts} failed; "
                               f"retrying in {delay:.1f}s")
            else:
                error = value if status == "failed" else INTERNAL_ERROR
                self._fail(attempt, error)
                signal = JobFailed(error)
        except LeaseLost:
            log.warning("celery-lease: job %s: lease lost; %s outcome discarded", attempt.job_id, status)
            return None
        if signal is not None:
            raise signal
        return None

    def _record(self, conn, attempt: Attempt, event: Event, detail: str | None = None) -> None:
        if attempt.run_id is not None:
            self.store.append_events(
                [q.event_row(attempt.run_id, attempt.job_id, event, attempt.attempt, detail)],
                connection=conn,
            )

    def _fenced(self, conn, stmt, attempt: Attempt, **params) -> None:
        if not self.store.fenced(conn, stmt, **attempt.fence, **params):
            attempt.lost.set()
            raise LeaseLost()

    def _succeed(self, ctx: JobContext, attempt: Attempt, result: Any) -> Any:
        staged = ctx.staged
        if self.completer is not None and not (staged.effects or staged.children or attempt.run_id):
            self.completer.add(attempt, result, ctx.pending_progress)
            return result
        children_rows = [self.leases.job_row(child, payload, options)
                         for child, payload, options in staged.children]

        def work(conn):
            # The fenced update goes first: on PostgreSQL it locks the row, so a cancel
            # or reap waits for this transaction, and if the lease is already lost
            # nothing below runs and the whole transaction rolls back.
            self._fenced(conn, q.complete_job(), attempt, new_result=result, new_progress=ctx.pending_progress)
            for fn in staged.effects:
                fn(conn)
            # A child placed in another run than this job's must respect that run as a
            # submit would: the run is created if new, and a cancelled one takes no job.
            # (This job's own run cannot be cancelled here: cancel_run would have
            # revoked this lease and the fenced update above would have failed.)
            refused = {run for run in {r["run_id"] for r in children_rows} - {attempt.run_id, None}
                       if not self.store.ensure_run(run, connection=conn)}
            for row in [r for r in children_rows if r["run_id"] in refused]:
                log.warning("celery-lease: job %s: child %s not created: run %s is cancelled",
                            attempt.job_id, row["kind"], row["run_id"])
            rows = [r for r in children_rows if r["run_id"] not in refused]
            # keyed: a child submitted with an idempotency key that already exists is that
            # job, as with submit; only the children actually inserted are returned.
            children = self.store.insert_jobs(rows, keyed=True, connection=conn) if rows else []
            self._record(conn, attempt, Event.SUCCEEDED)
            self.store.append_events([
                q.event_row(c.run_id, c.id, Event.DISPATCHED, 0, f"child of {attempt.job_id}")
                for c in children if c.run_id is not None
            ], connection=conn)
            return children

        alone = not (staged.effects or children_rows or attempt.run_id)  # SQLite: nothing to batch
        children = self.store.run(self.store.engine(fast=True, single=alone), work)
        self.leases.publish_wakeups(children)
        return result

    def _fail(self, attempt: Attempt, error: str) -> None:
        def work(conn):
            self._fenced(conn, q.fail_job(), attempt, new_error=error)
            self._record(conn, attempt, Event.FAILED, error)

        self.store.run(self.store.fast, work)

    def _retry(self, attempt: Attempt, delay: float) -> None:
        def work(conn):
            self._fenced(conn, q.retry_job(), attempt, delay=delay)
            self._record(conn, attempt, Event.RETRIED, f"in {delay:.1f}s")

        self.store.run(self.store.fast, work)

    def _hand_off(self, attempt: Attempt) -> None:
        """Warm shutdown: back to pending at once, attempt not spent, wakeup sent."""

        def work(conn):
            row = conn.execute(q.hand_off_job(), attempt.fence).mappings().first()
            if row is None:
                raise LeaseLost()
            self._record(conn, attempt, Event.REQUEUED, "shutdown handoff")
            return dict(row)

        row = self.store.run(self.store.fast, work)
        log.info("celery-lease: job %s: handed off on shutdown", attempt.job_id)
        self.leases.publish_wakeups([row])
