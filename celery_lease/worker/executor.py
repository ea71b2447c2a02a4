"""The lease life inside a worker process: claim, run the body, record the outcome.

The Celery signals in :mod:`celery_lease.worker.signals` call these at their moments:
``task_prerun`` -> :meth:`WorkerState.begin`, the task body -> :meth:`WorkerState.execute`,
``task_postrun`` -> :meth:`WorkerState.end`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from celery.exceptions import Retry

from celery_lease.db import queries as q
from celery_lease.errors import (
    DatabaseUnavailable,
    Failure,
    JobCancelled,
    JobFailed,
    JobRefused,
    JobSnoozed,
    JobSuspended,
    LeaseError,
    LeaseLost,
)
from celery_lease.payload import UnstorableValue, cap_error
from celery_lease.status import Event, Status
from celery_lease.worker import shutdown
from celery_lease.worker.attempt import Attempt, owner_of
from celery_lease.worker.completion import Completer
from celery_lease.worker.context import JobContext
from celery_lease.worker.heartbeat import Heartbeat
from celery_lease.worker.outcome import INTERNAL_ERROR, TIMED_OUT, Outcome, backoff

if TYPE_CHECKING:
    from celery_lease.canvas import Canvas
    from celery_lease.db.store import Store
    from celery_lease.flow.control import FlowControl
    from celery_lease.kinds import JobKind, Registry
    from celery_lease.producer import Producer
    from celery_lease.settings import Settings

log = logging.getLogger("celery_lease.worker")

_RUNNING, _CANCELLED = Status.RUNNING.value, Status.CANCELLED.value  # (an enum's .value is a slow lookup)


class WorkerState:
    """Per-process worker side of celery-lease."""

    def __init__(
        self,
        store: Store,
        producer: Producer,
        registry: Registry,
        settings: Settings,
        broker_url: str | None,
        notice_channel: str | None = None,
        *,
        canvas: Canvas | None = None,
        eager: bool = False,
        flow: FlowControl | None = None,
    ) -> None:
        self.store = store
        #: Which claim a delivery takes, and the release of a limited job's slot. None
        #: (eager mode): the claim's own guards (pause, priority) only, no limits.
        self.flow = flow
        #: Chains, callbacks and chords stored in job rows (celery_lease/canvas.py).
        self.canvas = canvas
        #: In-process (eager) runs apply plain follow-ups in-process too.
        self.eager = eager
        self.producer = producer
        self.registry = registry
        self.settings = settings
        self.heartbeat = Heartbeat(store, broker_url, notice_channel, on_timeout=self._time_out)
        #: Batches plain successes on PostgreSQL, where each statement is a round trip.
        self.completer = Completer(store, on_written=self._release) if store.dialect == "postgresql" else None
        #: What a claim whose reply was lost needs to know before it adopts a job found
        #: running under this process (Store.claim): claims in progress here per job,
        #: and the attempts that live here until their outcome is written.
        self._claiming: dict[str, int] = {}
        self._live: set[tuple[str, int]] = set()
        self._lock = threading.Lock()

    def _release(self, attempt: Attempt) -> None:
        with self._lock:
            self._live.discard(attempt.key)

    def _may_adopt(self, job_id: str, generation: int) -> bool:
        with self._lock:
            return self._claiming.get(job_id) == 1 and (job_id, generation) not in self._live

    # --- task_prerun / task_postrun ------------------------------------------------

    def begin(self, job_id: str, spec: JobKind, hostname: str | None, queue: str | None) -> Attempt | None:
        """Claim the job named by the delivery; None when it is not claimable."""
        if shutdown.requested():
            # Warm shutdown: leave the job pending, and since this (early-acked)
            # delivery is spent, wake another worker for it now rather than after the
            # sweeper's staleness threshold: on the job's own queue (the row's; this
            # delivery's routing key need not name a queue), and only if it is pending.
            try:
                self.producer.publish_wakeups(self.store.pending_wakeups([job_id]))
            except LeaseError:
                log.warning("celery-lease: job %s: not re-woken at shutdown; the sweeper will", job_id)
            return None
        with self._lock:
            self._claiming[job_id] = self._claiming.get(job_id, 0) + 1
        sent_at = time.monotonic()
        owner = owner_of(hostname)

        def may_adopt(generation: int) -> bool:
            return self._may_adopt(job_id, generation)

        # This process's waiting successes ride on the claim (Completer.take).
        riding = self.completer.take() if self.completer is not None else None
        try:
            if self.flow is not None:
                row = self.flow.claim(job_id, spec, owner, queue, may_adopt=may_adopt, successes=riding)
            else:
                row = self.store.claim(job_id, owner, spec.task, may_adopt=may_adopt, successes=riding)
            if row is not None and row.get("status", _RUNNING) == _RUNNING:
                with self._lock:
                    self._live.add((str(row["id"]), row["lease_generation"]))
        finally:
            with self._lock:
                self._claiming[job_id] -= 1
                if not self._claiming[job_id]:
                    del self._claiming[job_id]
            if riding is not None:
                self.completer.settle(riding)  # type: ignore[union-attr]  # riding comes from it
        if row is None or row.get("status") == _CANCELLED:
            if row is None:
                log.info("celery-lease: job %s: duplicate or not claimable delivery; skipped", job_id)
            else:
                log.info("celery-lease: job %s: its run is cancelled; cancelled, not started", row["id"])
            return None
        # A higher-priority job may be claimed in place of the delivered one.
        attempt = Attempt.from_claim(str(row["id"]), row, sent_at=sent_at)
        if spec.timeout is not None:
            attempt.deadline = sent_at + spec.timeout
        self.heartbeat.add(attempt)
        return attempt

    def end(self, attempt: Attempt | None) -> None:
        if attempt is not None:
            self.heartbeat.remove(attempt)
            if self.flow is not None:  # its outcome is written: a held job may take its slot
                self.flow.release([{"kind": attempt.kind, "concurrency_key": attempt.concurrency_key}])
            if not attempt.pending_write:  # else the completer releases it once written
                self._release(attempt)

    def flush(self) -> None:
        if self.completer is not None:
            self.completer.flush()

    # --- the body --------------------------------------------------------------------

    def context(self, attempt: Attempt, on_progress: Callable[[Any], None] | None = None) -> JobContext:
        """The handler's view of ``attempt``; raises CheckpointTooLarge for a stored
        checkpoint over the cap."""
        return JobContext(
            attempt,
            store=self.store,
            producer=self.producer,
            registry=self.registry,
            heartbeat=self.heartbeat,
            max_checkpoint_bytes=self.settings.max_checkpoint_bytes,
            on_progress=on_progress,
            max_progress_bytes=self.settings.max_progress_bytes,
        )

    def execute(self, spec: JobKind, attempt: Attempt, on_progress: Callable[[Any], None] | None = None) -> Any:
        """Run the handler and record its outcome with one fenced statement.

        Returns the stored result. Raises Celery's Retry or JobFailed *after* the
        outcome is recorded, so Flower shows RETRY / FAILURE for the job id; both are
        raised outside any ``except`` block so no traceback of the handler's exception
        (and its text) is chained into Celery's log line or event.
        """
        outcome: tuple[Outcome, Any]
        try:
            # Inside the try: a stored checkpoint over the cap fails this attempt as an
            # internal error (logged with the job id), it does not escape the lease.
            ctx = self.context(attempt, on_progress)
            result = spec.fn(ctx, spec.codec.load_payload(attempt.payload))
            # A result the table cannot hold (not JSON, over its cap, NUL, lone
            # surrogate) is refused here, before it joins a batch of successes.
            outcome = (Outcome.SUCCEEDED, spec.codec.dump_result(result, self.settings.max_result_bytes))
        except Failure as exc:
            outcome = (Outcome.FAILED, cap_error(exc.message))
        except UnstorableValue as exc:
            # Retrying cannot make the value storable: failed at once, with our own
            # message (it names the value and the reason, never quotes the value).
            log.warning("celery-lease: job %s (%s) attempt %d: %s", attempt.job_id, spec.kind, attempt.attempt, exc)
            outcome = (Outcome.FAILED, cap_error(str(exc)))
        except JobSuspended:
            outcome = (Outcome.SUSPENDED, None)
        except JobSnoozed as exc:
            outcome = (Outcome.SNOOZED, exc.seconds)
        except JobCancelled:
            outcome = (Outcome.CANCELLED, None)
        except Exception:
            log.exception("celery-lease: job %s (%s) attempt %d raised", attempt.job_id, spec.kind, attempt.attempt)
            outcome = (Outcome.ERROR, None)

        status, value = outcome
        signal: Exception | None = None  # what Celery is told, after the write
        try:
            if status is Outcome.SUCCEEDED:
                try:
                    stored = self._succeed(ctx, attempt, value)
                    attempt.outcome = Outcome.SUCCEEDED
                    return stored
                except (LeaseLost, DatabaseUnavailable):
                    raise
                except Exception:
                    # An effect or a child insert raised: the success transaction rolled
                    # back whole, the job still runs under this lease, and the attempt
                    # ends like a handler that raised.
                    log.exception(
                        "celery-lease: job %s (%s) attempt %d: success transaction failed",
                        attempt.job_id,
                        spec.kind,
                        attempt.attempt,
                    )
                    status = Outcome.ERROR
            attempt.outcome = status
            if status is Outcome.SUSPENDED:
                self._hand_off(attempt)
            elif status is Outcome.SNOOZED:
                self._snooze(attempt, value)  # type: ignore[arg-type]  # the snooze's seconds
            elif status is Outcome.CANCELLED:
                log.info("celery-lease: job %s: stopped after cancel or lease loss", attempt.job_id)
            elif status is Outcome.ERROR and attempt.attempt < attempt.max_attempts:
                delay = backoff(attempt.attempt, spec.retry_backoff, spec.retry_backoff_max)
                self._retry(attempt, delay)
                signal = Retry(f"attempt {attempt.attempt} of {attempt.max_attempts} failed; retrying in {delay:.1f}s")
            else:
                error = str(value) if status is Outcome.FAILED else INTERNAL_ERROR
                self._fail(attempt, error)
                # A Failure is an outcome the handler chose: Celery logs it without a traceback.
                signal = JobRefused(error) if status is Outcome.FAILED else JobFailed(error)
        except LeaseLost:
            attempt.outcome = None
            log.warning("celery-lease: job %s: lease lost; %s outcome discarded", attempt.job_id, status.value)
            return None
        if signal is not None:
            raise signal
        return None

    def _succeed(self, ctx: JobContext, attempt: Attempt, result: Any) -> Any:
        staged = ctx.staged
        if attempt.is_lost:  # by its own clock too: write nothing more
            raise LeaseLost()
        followup = self.canvas.after_success(attempt, result, eager=self.eager) if self.canvas and attempt.canvas else None
        # (Not batched for a limited kind: its slot is freed once the success is written.)
        limited = self.flow is not None and self.flow.holds_slot(attempt.kind)
        if self.completer is not None and not (staged.effects or staged.children or attempt.run_id or followup or limited):
            attempt.pending_write = True
            self.completer.add(attempt, result, ctx.pending_progress)
            return result
        children_rows = [self.producer.job_row(child, payload, options) for child, payload, options in staged.children]

        def work(conn):
            # The fenced update goes first: on PostgreSQL it locks the row, so a cancel
            # or reap waits for this transaction, and if the lease is already lost
            # nothing below runs and the whole transaction rolls back.
            attempt.fenced(self.store, conn, q.complete_job(), new_result=result, new_progress=ctx.pending_progress)
            for fn in staged.effects:
                fn(conn)
            # A child placed in another run than this job's must respect that run as a
            # submit would: the run is created if new, and a cancelled one takes no job.
            # (This job's own run cannot be cancelled here: cancel_run would have
            # revoked this lease and the fenced update above would have failed.)
            refused = {
                run
                for run in {r["run_id"] for r in children_rows} - {attempt.run_id, None}
                if not self.store.ensure_run(run, connection=conn)
            }
            for row in [r for r in children_rows if r["run_id"] in refused]:
                log.warning(
                    "celery-lease: job %s: child %s not created: run %s is cancelled", attempt.job_id, row["kind"], row["run_id"]
                )
            rows = [r for r in children_rows if r["run_id"] not in refused]
            # keyed: a child submitted with an idempotency key that already exists is that
            # job, as with submit; only the children actually inserted are returned.
            children = self.store.insert_jobs(rows, keyed=True, connection=conn) if rows else []
            if followup is not None:  # the next chain step, callbacks, a chord's body
                children += followup.write(conn)
            self.store.log_events(
                conn, [(attempt, Event.SUCCEEDED, None)] + [(c, Event.DISPATCHED, f"child of {attempt.job_id}") for c in children]
            )
            return children

        alone = not (staged.effects or children_rows or attempt.run_id or followup)  # SQLite: nothing to batch
        retried: list[bool] = []

        def note_retry() -> None:
            retried.append(True)

        try:
            # Durable: once this commits, wait() and the API may report the success.
            children = attempt.ride_out(
                lambda: self.store.transaction(self.store.engine(single=alone), work, on_retry=note_retry), note_retry
            )
        except LeaseLost:
            # Retried after a dropped connection: the first try may have committed
            # before its reply was lost (its children are then woken by the sweeper).
            if retried and self.store.landed_successes([attempt.key]):
                log.warning("celery-lease: job %s: success had landed before the reply was lost", attempt.job_id)
                return result
            raise
        self.producer.publish_wakeups(children)
        if followup is not None:
            followup.send()
        return result

    def _time_out(self, attempt: Attempt) -> None:
        """The heartbeat found ``attempt`` past its kind's timeout: record a retry (or,
        with no attempt left, a failure) now; the heartbeat then marks it lost, so the
        handler stops at its next check and nothing it writes afterwards lands."""
        spec = self.registry.resolve(attempt.kind)
        log.warning(
            "celery-lease: job %s (%s) attempt %d timed out after %ss; stopping it",
            attempt.job_id,
            spec.kind,
            attempt.attempt,
            spec.timeout,
        )
        try:
            if attempt.attempt < attempt.max_attempts:
                delay = backoff(attempt.attempt, spec.retry_backoff, spec.retry_backoff_max)
                self._retry(attempt, delay, why="timed out")
            else:
                self._fail(attempt, TIMED_OUT)
        except LeaseLost:
            log.info("celery-lease: job %s: lease already lost at its timeout", attempt.job_id)

    def _fail(self, attempt: Attempt, error: str) -> None:
        followup = self.canvas.after_failure(attempt, error, eager=self.eager) if self.canvas and attempt.canvas else None

        def work(conn):
            attempt.fenced(self.store, conn, q.fail_job(), new_error=error)
            created = followup.write(conn) if followup is not None else []  # link_error jobs
            self.store.log_events(
                conn, [(attempt, Event.FAILED, error)] + [(c, Event.DISPATCHED, f"errback of {attempt.job_id}") for c in created]
            )
            return created

        created = attempt.ride_out(lambda: self.store.transaction(self.store.durable, work))
        if followup is not None:
            self.producer.publish_wakeups(created)
            followup.send()

    def _retry(self, attempt: Attempt, delay: float, why: str | None = None) -> None:
        def work(conn):
            attempt.fenced(self.store, conn, q.retry_job(), delay=delay)
            detail = f"in {delay:.1f}s" if why is None else f"{why}; in {delay:.1f}s"
            self.store.log_events(conn, [(attempt, Event.RETRIED, detail)])

        attempt.ride_out(lambda: self.store.transaction(self.store.durable, work))

    def _hand_off(self, attempt: Attempt) -> None:
        """Warm shutdown: back to pending at once, attempt not spent, wakeup sent."""

        def work(conn):
            if attempt.is_lost:
                raise LeaseLost()
            row = conn.execute(q.hand_off_job(), attempt.fence).mappings().first()
            if row is None:
                attempt.mark_lost()
                raise LeaseLost()
            self.store.log_events(conn, [(attempt, Event.REQUEUED, "shutdown handoff")])
            return dict(row)

        row = attempt.ride_out(lambda: self.store.transaction(self.store.durable, work))
        log.info("celery-lease: job %s: handed off on shutdown", attempt.job_id)
        self.producer.publish_wakeups([row])

    def _snooze(self, attempt: Attempt, seconds: float) -> None:
        """ctx.snooze(): back to pending, due in ``seconds``, attempt not spent."""

        def work(conn):
            row = conn.execute(q.snooze_job(), {**attempt.fence, "delay": seconds}).mappings().first()
            if row is None:
                attempt.mark_lost()
                raise LeaseLost()
            self.store.log_events(conn, [(attempt, Event.REQUEUED, f"snoozed for {seconds:g}s")])
            return dict(row)

        row = self.store.transaction(self.store.fast, work)
        log.info("celery-lease: job %s: snoozed for %gs", attempt.job_id, seconds)
        if seconds <= 0:
            self.producer.publish_wakeups([row])
