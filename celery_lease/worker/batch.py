"""A batched kind's deliveries (``@leases.job(kind=..., batch=N)``, PostgreSQL).

One wakeup of the kind lets its worker process:

1. claim up to N due jobs of the kind and queue in ONE durable statement
   (lifecycle.batch.CLAIM_BATCH): each row gets its own attempt, lease and fencing
   token, and its ``claimed`` event;
2. run their handlers one after another (the delivery's own job first, if it was
   claimed), each through the same path as a single job (WorkerState.execute): its own
   context, checkpoints, progress, errors, retries, snooze, effects and children;
   meanwhile the process's heartbeat renews every lease of the batch in its one
   statement per round, so a job waiting its turn keeps its lease;
3. complete the plain successes (nothing else to commit) in ONE statement, the
   completer's (complete_jobs, with their run events), each row fenced by its own
   generation: a lost lease on one row leaves the others written; a row missing from
   the result is re-checked alone (fenced), by the completer's algorithm
   (completion.write_successes), and tried again through a database outage as the
   completer's are (completion.complete_within_leases): the next handler waits, the
   bodies that finished keep their attempt. Any other outcome is written as it comes,
   by its own transition.

Successes are not held back for long: after a handler that took FLUSH_AFTER or more,
and once the oldest waiting success has waited FLUSH_AFTER, the waiting ones are written
before the next handler starts. A process killed mid-batch therefore re-runs no job whose
handler ended more than about FLUSH_AFTER before the kill: the jobs still running under
its leases (unstarted, running, or ended in the last instant) are requeued by the reaper
when their leases expire, exactly as a single job's.

Wakeups: a ``submit_many`` of a batched kind publishes one wakeup per N jobs
(producer.py); every other job is reached by a batch. A batch that came back full (the
claim saw a job beyond its N) wakes the kind again at once for the rest, so nothing
depends on which wakeup named which job. A delivery whose job is running in a batch of
this process is a duplicate skipped without a statement; any other delivery runs the
claim (it may find other due jobs). A job left pending with no wakeup by a crash is
re-woken by the sweeper, as any other.

Celery's tools: every job of the batch is a task of its own. The delivery's job has
Celery's task events and the attempt span task_prerun started; each other job gets an
attempt span of its own (a child of its own submit) and, when the worker sends events,
its own task events (worker.events.BatchTasks), so Flower lists every job. Their
results are their rows, as every leased job's (``AsyncResult(job.id)``).

A limited kind (``concurrency=``, ``rate_limit=``, or an operator's override) claims
with CLAIM_BATCH_LIMITED, under its limits row lock: the batch is bounded by the free
slots and the rate window, and the refused rows are held as a single claim's are. A
kind with a concurrency limit writes each success at once (record.succeed: its slot
is freed and held jobs woken by its transition); successes the batch writes free any
slot they hold too (Batches.release).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from celery.exceptions import Retry

from celery_lease import tracing
from celery_lease.errors import DatabaseUnavailable, JobFailed, JobRefused, LeaseLost
from celery_lease.flow.store import declared_limits
from celery_lease.lifecycle.batch import claim_batch
from celery_lease.lifecycle.owner import owner_of
from celery_lease.worker import shutdown
from celery_lease.worker.attempt import Attempt
from celery_lease.worker.completion import Riding, complete_within_leases, write_successes
from celery_lease.worker.outcome import Outcome

if TYPE_CHECKING:
    from celery_lease.kinds import JobKind
    from celery_lease.worker.events import BatchTasks

log = logging.getLogger("celery_lease.worker")

_CANCELLED = "cancelled"

#: Seconds a batch's successes may wait for one statement (see the module's docstring).
FLUSH_AFTER = 0.05
#: A kind with no ``batch=``: a claim takes about this many seconds of its bodies ...
CLAIM_SECONDS = 0.05
#: ... and at most this many jobs (Batches.size).
DEFAULT_CAP = 100


class Batches:
    """The batched deliveries of one worker process."""

    def __init__(self, state: Any) -> None:
        #: The process's WorkerState (worker/executor.py, which owns this object).
        self._state = state
        #: Per kind with no ``batch=``: how long its attempts took here (a moving average).
        self._took: dict[str, float] = {}

    def size(self, spec: JobKind) -> int:
        """How many jobs a claim of ``spec`` takes: its ``batch=``; else as many as run in
        about CLAIM_SECONDS by what its attempts took in this process (one until one ran:
        a lone job, or a long one, is not held behind another), at most DEFAULT_CAP."""
        if spec.batch is not None:
            return spec.batch
        took = self._took.get(spec.kind)
        if took is None:
            return 1
        return max(1, min(DEFAULT_CAP, int(CLAIM_SECONDS / max(took, CLAIM_SECONDS / DEFAULT_CAP))))

    def _measured(self, spec: JobKind, took: float) -> None:
        if spec.batch is None:
            before = self._took.get(spec.kind)
            self._took[spec.kind] = took if before is None else 0.8 * before + 0.2 * took

    # --- task_prerun ---------------------------------------------------------------------

    def begin(self, job_id: str, spec: JobKind, hostname: str | None) -> Attempt | None:
        """Claim the delivery's batch; its lead attempt (``attempt.batch`` holds them all),
        or None when nothing was claimed."""
        state = self._state
        with state._lock:
            if any(key[0] == job_id for key in state._live):
                # Running here in a batch: this wakeup is a duplicate; no statement.
                log.debug("celery-lease: job %s: running in a batch here; delivery skipped", job_id)
                return None
        sent_at = time.monotonic()
        owner = owner_of(hostname)
        params = {"job_id": job_id, "wakeup_task": spec.task, "owner": owner, "n": self.size(spec)}
        limited = state.flow is not None and state.flow.limited(spec)
        for _ in range(2):
            if limited:
                params.update(declared_limits(spec.kind, spec.limits))
            # A re-run of the claim after a lost reply adopts the rows its first try took, by
            # the claim's token, never other rows (lifecycle.batch.claim_batch).
            found = claim_batch(state.store, params, limited=limited)
            if limited or not (found and found[0].get("overridden")) or state.flow is None:
                break
            # Refused by an override this process had not read: claimed on the limited path.
            limited = state.flow.limited(spec, fresh=True)
        rows = [r for r in found if r["id"] is not None]  # (nothing claimed: one row of NULLs)
        with state._lock:
            state._live.update((str(r["id"]), r["lease_generation"]) for r in rows if r["status"] != _CANCELLED)
        paused = bool(found and found[0]["paused"])
        if limited and found and not paused:
            self._limited_follow_ups(job_id, spec, found[0], any(str(r["id"]) == job_id for r in rows))
            if not rows and found[0]["next_id"] is not None:
                # A limit refused every row picked (now held), and more are due: woken as
                # a full batch's rest is, so the held rows do not hide them.
                self._wake(spec, found[0]["next_id"], found[0]["next_queue"])
        if not rows:
            self._nothing_claimed(job_id, spec, paused=paused)
            return None
        attempts = [Attempt.from_claim(str(r["id"]), r, sent_at=sent_at) for r in rows if r["status"] != _CANCELLED]
        attempts.sort(key=lambda a: a.job_id != job_id)  # the delivery's own job first
        # The attempts join the heartbeat before the claim's follow-ups, which a slow
        # broker or database may hold (as a single claim's: executor.begin).
        if not any(a.late_to_start for a in attempts):
            for a in attempts:
                state.heartbeat.add(a)
        following = rows[0]["next_id"]
        if following is not None:
            # Full: what is left of the kind gets a wakeup now, for another process.
            self._wake(spec, following, rows[0]["queue"])
        for row in rows:
            if row["status"] == _CANCELLED:
                log.info("celery-lease: job %s: its run is cancelled; cancelled, not started", row["id"])
                state.pipeline.claim_cancelled(row)
        if not attempts:
            return None
        if any(a.late_to_start for a in attempts):
            for a in attempts:
                state._hand_off_late(a)
            return None
        lead = attempts[0]
        lead.batch = attempts
        if spec.timeout is not None:
            lead.deadline = sent_at + spec.timeout
        log.info("celery-lease: job %s (%s): claimed a batch of %d", job_id, spec.kind, len(attempts))
        return lead

    def _limited_follow_ups(self, job_id: str, spec: JobKind, first: dict[str, Any], own: bool) -> None:
        """A limited kind's batch: what its rate window asks for, and a delivery whose own
        job it did not claim (``own``) followed up as a single limited claim's
        (FlowControl.batch_claimed). Never fails the delivery: what is not woken is the
        sweeper's to recover."""
        try:
            self._state.flow.batch_claimed(job_id, spec, first, own)
        except Exception:
            what = "wakeups after its batch claim not sent; the sweeper will"
            log.warning("celery-lease: job %s (%s): %s", job_id, spec.kind, what, exc_info=True)

    def _nothing_claimed(self, job_id: str, spec: JobKind, *, paused: bool) -> None:
        """A paused kind's delivery is held for its resume (FlowControl.hold marks it);
        any other is a duplicate, or found its jobs taken by other batches: skipped with
        no statement beyond the claim."""
        state = self._state
        if paused and state.flow is not None:
            state.flow.hold(job_id, spec)
        log.info("celery-lease: job %s: duplicate or not claimable delivery; skipped", job_id)

    def _wake(self, spec: JobKind, job_id: str, queue: str | None) -> None:
        try:
            # Coalesced as a submit's: a wakeup of the kind already on its way takes the rest.
            self._state.producer.publish_wakeups([{"id": job_id, "task": spec.task, "queue": queue}], coalesce=True)
        except Exception:
            log.warning("celery-lease: %s: the rest of a full batch not woken; the sweeper will", spec.kind)

    # --- the body --------------------------------------------------------------------------

    def run(
        self, spec: JobKind, lead: Attempt, on_progress: Callable[[Any], None] | None, tasks: BatchTasks | None = None
    ) -> Any:
        """Run every attempt of ``lead``'s batch, one after another; returns the lead's
        value and raises the lead's Retry / JobRefused / JobFailed, after the whole batch
        (Celery reports the delivery's task as its own job's outcome; ``tasks`` sends
        the task events of the others, when the worker sends events)."""
        successes = BatchSuccesses(self)
        value: Any = None
        signal: Exception | None = None
        assert lead.batch is not None
        try:
            for a in lead.batch:
                if a is not lead and not self._may_start(spec, a):
                    continue
                started = time.monotonic()
                if a is lead:
                    value, signal = self._execute(spec, a, on_progress, successes)
                else:
                    self._execute_own_task(spec, a, successes, tasks)
                self._measured(spec, time.monotonic() - started)
                if not a.pending_write:
                    self._done(a)
                if successes.due(time.monotonic() - started):
                    successes.flush()
        finally:
            try:
                successes.flush()
            finally:
                if tasks is not None:
                    tasks.close()
        if signal is not None:
            raise signal
        return value

    def _execute(
        self, spec: JobKind, a: Attempt, on_progress: Callable[[Any], None] | None, successes: BatchSuccesses
    ) -> tuple[Any, Exception | None]:
        """Run one attempt of the batch: its value, or the Retry / JobRefused / JobFailed
        it raised once its outcome was recorded."""
        try:
            with tracing.current(a):
                return self._state.execute(spec, a, on_progress, completer=successes), None
        except (Retry, JobRefused, JobFailed) as exc:  # recorded already
            return None, exc
        except (LeaseLost, DatabaseUnavailable):
            log.warning("celery-lease: job %s: outcome not written; the reaper will requeue it", a.job_id)
            return None, None

    def _execute_own_task(self, spec: JobKind, a: Attempt, successes: BatchSuccesses, tasks: BatchTasks | None) -> None:
        """A job of the batch other than the delivery's: an attempt span and task events
        of its own (the delivery's come from task_prerun / task_postrun and Celery)."""
        clock = tracing.clock()
        if clock is not None:
            tracing.start_attempt(a, a.queue or spec.queue, clock, None)
        if tasks is not None:
            tasks.started(a)
        began = time.monotonic()
        try:
            value, raised = self._execute(spec, a, None, successes)
        finally:
            tracing.end_attempt(a)
        if tasks is None:
            return
        if isinstance(raised, Retry):
            tasks.retried(a, raised)
        elif raised is not None:
            tasks.failed(a, raised)
        elif a.outcome is Outcome.SUCCEEDED:
            tasks.succeeded(a, value, time.monotonic() - began)
        else:
            tasks.stopped(a)

    def _may_start(self, spec: JobKind, a: Attempt) -> bool:
        """Whether the next attempt of a batch starts: not once its lease is lost while it
        waited (cancelled, reaped), nor on warm shutdown (handed off, attempt not spent)."""
        if a.is_lost:
            log.info("celery-lease: job %s: lease lost while waiting in its batch; not started", a.job_id)
            self._done(a)
            return False
        if shutdown.requested():
            try:
                self._state.record.hand_off(a)
            except (LeaseLost, DatabaseUnavailable):
                log.warning("celery-lease: job %s: not handed off at shutdown; the reaper will", a.job_id)
            self._done(a)
            return False
        if spec.timeout is not None:
            a.deadline = time.monotonic() + spec.timeout  # its own run, from its own start
        return True

    def _done(self, a: Attempt) -> None:
        """``a`` ended (its outcome written, or given up): no more renewals, no longer here."""
        self._state.heartbeat.remove(a)
        self._state._release(a)

    def release(self, attempts: list[Attempt]) -> None:
        """Successes written by the batch (not through a transition, which releases its
        own rows): the slots of a concurrency limit they held are freed, and the jobs it
        held woken (FlowControl.release; a kind with no such limit costs nothing)."""
        flow = self._state.flow
        if flow is not None:
            flow.release([{"kind": a.kind, "concurrency_key": a.concurrency_key} for a in attempts])

    # --- the completion --------------------------------------------------------------------

    def complete(self, items: list[tuple[Attempt, Any, Any]]) -> None:
        """Write these successes in one statement, as the completer does (complete_jobs:
        their run events too; after a lost reply, those that landed count as written),
        tried again through a database outage as the completer's are. (The batch waits
        meanwhile: on warm shutdown it stops waiting once every lease lapsed by its own
        clock, and leaves them to the reaper, as a single job's outcome would be.)"""
        store = self._state.store

        def stopping(live: list[tuple[Attempt, Any, Any]]) -> bool:
            return shutdown.requested() and all(a.is_lost for a, _, _ in live)

        write_successes(self._state.pipeline, items, lambda live: complete_within_leases(store, live, lambda: stopping(live)))


class BatchSuccesses:
    """A batch's plain successes (worker.completion.Completer): kept until the batch
    writes them, in one statement (:meth:`Batches.complete`)."""

    def __init__(self, batches: Batches) -> None:
        self._batches = batches
        self._items: list[tuple[Attempt, Any, Any]] = []
        self._since = 0.0

    def add(self, attempt: Attempt, result: Any, progress: Any) -> None:
        if not self._items:
            self._since = time.monotonic()
        self._items.append((attempt, result, progress))

    def take(self) -> None:
        return None

    def settle(self, riding: Riding) -> None:
        raise AssertionError("a batch's successes ride on no claim")

    def due(self, last_took: float) -> bool:
        """Whether the waiting successes are written before the next handler starts."""
        return bool(self._items) and (last_took >= FLUSH_AFTER or time.monotonic() - self._since >= FLUSH_AFTER)

    def flush(self, timeout: float = 10.0) -> None:
        items, self._items = self._items, []
        if not items:
            return
        heartbeat = self._batches._state.heartbeat
        for attempt, _, _ in items:
            # No renewal from here on: one that ran after this statement committed found
            # the row succeeded and, the attempt still held, logged a false "lease lost
            # (cancelled or reaped)". (Its body is over; the write is fenced and brief.)
            heartbeat.remove(attempt)
        try:
            self._batches.complete(items)
        except Exception:
            log.exception("celery-lease: cannot record %d successes; the reaper will requeue them", len(items))
        finally:
            for attempt, _, _ in items:
                attempt.pending_write = False
                self._batches._done(attempt)
            self._batches.release([a for a, _, _ in items])
