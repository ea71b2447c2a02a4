"""The lease life inside a worker process: claim, run the body, record the outcome.

The Celery signals in :mod:`celery_lease.worker.signals` call these at their moments:
``task_prerun`` -> :meth:`WorkerState.begin`, the task body -> :meth:`WorkerState.execute`,
``task_postrun`` -> :meth:`WorkerState.end`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from celery.exceptions import Retry

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
from celery_lease.lifecycle.claim import ClaimFollowUps, claim_delivery
from celery_lease.lifecycle.owner import owner_of
from celery_lease.lifecycle.pipeline import Pipeline
from celery_lease.payload import UnstorableValue, cap_error
from celery_lease.status import Status
from celery_lease.worker import shutdown
from celery_lease.worker.attempt import Attempt
from celery_lease.worker.completion import Completer, completer_for
from celery_lease.worker.context import JobContext
from celery_lease.worker.heartbeat import Heartbeat
from celery_lease.worker.incident import incident
from celery_lease.worker.many_claim import ManyJobClaims
from celery_lease.worker.outcome import Outcome, backoff
from celery_lease.worker.record import Recorder
from celery_lease.worker.timeouts import Timeouts

if TYPE_CHECKING:
    from celery_lease.canvas import Canvas
    from celery_lease.db.store import Store
    from celery_lease.flow.control import FlowControl
    from celery_lease.kinds import JobKind, Registry
    from celery_lease.producer import Producer
    from celery_lease.settings import Settings

log = logging.getLogger("celery_lease.worker")

#: The run event detail of a job handed off by a claim whose reply came too late.
CLAIMED_LATE = "claimed too late in its lease"

_CANCELLED = Status.CANCELLED.value  # (an enum's .value is a slow lookup)


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
        #: Every end of an attempt, as a named transition (worker/record.py).
        self.pipeline = Pipeline(store, producer, canvas=canvas, flow=flow, eager=eager)
        #: Every ending but a success with effects or children: written together on
        #: PostgreSQL, where each statement is a round trip; at once on SQLite.
        self.completer: Completer = completer_for(store, self.pipeline)
        self.record = Recorder(store, producer, registry, self.pipeline, self.completer, canvas=canvas, flow=flow, eager=eager)
        self.timeouts = Timeouts(self.record.time_out)
        self.heartbeat = Heartbeat(store, broker_url, notice_channel, on_timeout=self.timeouts.submit)
        #: The deliveries that claim what is due: many jobs per claim (worker/many_claim.py).
        self.many_claims = ManyJobClaims(self)

    # --- task_prerun / task_postrun ------------------------------------------------

    def begin(self, job_id: str, spec: JobKind, hostname: str | None, routing_key: Any = None) -> Attempt | None:
        """Claim the job named by the delivery (``routing_key``: as delivered), or what is
        due of its kind; None when nothing is claimable."""
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
        if self._claims_many(spec):
            return self.many_claims.begin(job_id, spec, hostname, routing_key)
        sent_at = time.monotonic()
        owner = owner_of(hostname)
        # The claimed attempt joins the heartbeat as the claim's first follow-up, before
        # the others (a swapped job's new wakeup, a rate window's wake) that a slow broker
        # or database may hold. A job found in a cancelled run is cancelled by the claim:
        # its errbacks and chord follow once the claim committed.
        started: list[Attempt] = []
        follow_ups = ClaimFollowUps(
            claimed=lambda row: started.append(self._start(row, spec, sent_at)), cancelled=self.pipeline.claim_cancelled
        )
        try:
            if self.flow is not None:
                row = self.flow.claim(job_id, spec, owner, follow_ups=follow_ups)
            else:
                row = claim_delivery(self.store, job_id, owner, spec.task, follow_ups=follow_ups)
        except BaseException:
            for attempt in started:  # no body will run: its lease must not be renewed
                self.heartbeat.remove(attempt)
            raise
        if row is None or row.get("status") == _CANCELLED:
            if row is None:
                log.info("celery-lease: job %s: duplicate or not claimable delivery; skipped", job_id)
            else:
                log.info("celery-lease: job %s: its run is cancelled; cancelled, not started", row["id"])
            return None
        attempt = started[0] if started else self._start(row, spec, sent_at)
        if attempt.late_to_start:
            self._hand_off_late(attempt)
            return None
        return attempt

    def _claims_many(self, spec: JobKind) -> bool:
        """A delivery claims what is due of its kind (worker/many_claim.py): a kind with
        ``batch=``, or whose wakeups are coalesced (broker/waking.py), on a database that claims
        many rows in one statement. (In-process runs run the one job they name.)"""
        if self.eager or not self.store.capabilities.many_job_claims:
            return False
        waking = self.producer.waking
        return spec.batch is not None or (waking.enabled and waking.coalesces(spec.task))

    def _start(self, row: dict[str, Any], spec: JobKind, sent_at: float) -> Attempt:
        """The attempt the claim took (a higher-priority job may be claimed in place of
        the delivered one), its lease renewed from now on unless it came too late."""
        attempt = Attempt.from_claim(str(row["id"]), row, sent_at=sent_at)
        if spec.timeout is not None:
            attempt.deadline = sent_at + spec.timeout
        if not attempt.late_to_start:
            self.heartbeat.add(attempt)
        return attempt

    def _hand_off_late(self, attempt: Attempt) -> None:
        """The claim's reply came when its lease, counted from before it was sent, was
        nearly lapsed (a long wait for the kind's lock): the body must not start, since
        the reaper and another worker may take the job any moment. Handed off (fenced),
        its attempt not spent; if that cannot be written, the reaper requeues it."""
        # Unlike a body's outcome, the hand-off is right whenever it lands (it is fenced
        # by the generation and writes nothing of a body): this clock must not refuse it.
        self.heartbeat.remove(attempt)  # (joined before the claim's follow-ups, if it was on time then)
        attempt.renewed_at = time.monotonic()
        if not attempt.known_lost:  # lapsed by this clock only (the heartbeat saw it while follow-ups ran)
            attempt.lost.clear()
        log.warning("celery-lease: job %s: claimed too late in its lease; handed off, not started", attempt.job_id)
        try:
            self.record.hand_off(attempt, why=CLAIMED_LATE)
        except (LeaseLost, DatabaseUnavailable):
            log.warning("celery-lease: job %s: its late claim not handed off; the reaper will", attempt.job_id)

    def end(self, attempt: Attempt | None) -> None:
        for each in attempt.claimed_together or () if attempt is not None else ():
            if each is not attempt:
                self.end(each)  # (a no-op for those the many-job claim ended already)
        if attempt is not None:
            # (Its slot, if its kind is limited, was freed by the transition that moved
            # it out of running, once: its outcome's, or the cancel's or reap's.)
            self.heartbeat.remove(attempt)

    def flush(self) -> None:
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

    def execute(
        self,
        spec: JobKind,
        attempt: Attempt,
        on_progress: Callable[[Any], None] | None = None,
        *,
        one: bool = False,
    ) -> Any:
        """Run the handler and record its outcome with one fenced statement.

        Returns the stored result. Raises Celery's Retry or JobFailed *after* the
        outcome is recorded, so Flower shows RETRY / FAILURE for the job id; both are
        raised outside any ``except`` block so no traceback of the handler's exception
        (and its text) is chained into Celery's log line or event.

        A many-job claim's delivery (``attempt.claimed_together``) runs every job its claim
        took (worker/many_claim.py), each of them ``one`` at a time through here.
        """
        if attempt.claimed_together is not None and not one:
            return self.many_claims.run(spec, attempt, on_progress)
        outcome: tuple[Outcome, Any]
        try:
            # Inside the try: a stored checkpoint over the cap fails this attempt as an
            # internal error (logged with the job id), it does not escape the lease.
            ctx = self.context(attempt, on_progress)
            result = spec.fn(ctx, spec.codec.load_payload(attempt.payload))
            # A result the table cannot hold (not JSON, over its cap, NUL, lone
            # surrogate) is refused here, before it joins the successes the completer writes together.
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
        except Exception as exc:
            outcome = (Outcome.ERROR, self._incident(exc, attempt, spec.kind, "raised"))

        status, value = outcome
        signal: Exception | None = None  # what Celery is told, after the write
        try:
            if status is Outcome.SUCCEEDED:
                try:
                    self.record.succeed(ctx, attempt, value)
                    attempt.outcome = Outcome.SUCCEEDED
                    return value
                except (LeaseLost, DatabaseUnavailable):
                    raise
                except Exception as exc:
                    # An effect or a child insert raised: the success transaction rolled
                    # back whole, the job still runs under this lease, and the attempt
                    # ends like a handler that raised.
                    status, value = Outcome.ERROR, self._incident(exc, attempt, spec.kind, "success transaction failed")
            attempt.outcome = status
            if status is Outcome.SUSPENDED:
                self.record.hand_off(attempt)
            elif status is Outcome.SNOOZED:
                self.record.snooze(attempt, value)  # type: ignore[arg-type]  # the snooze's seconds
            elif status is Outcome.CANCELLED:
                log.info("celery-lease: job %s: stopped after cancel or lease loss", attempt.job_id)
            elif status is Outcome.ERROR and attempt.attempt < attempt.max_attempts:
                delay = backoff(attempt.attempt, spec.retry_backoff, spec.retry_backoff_max)
                self.record.retry(attempt, delay, why=str(value))
                # Celery's log line and its task-retried event (Flower's RETRY "exception",
                # which is Retry.exc) carry the same text-free error as the run's event.
                signal = Retry(
                    f"attempt {attempt.attempt} of {attempt.max_attempts} failed ({value}); retrying in {delay:.1f}s",
                    exc=JobFailed(str(value)),
                )
            else:
                error = str(value)
                self.record.fail(attempt, error)
                # A Failure is an outcome the handler chose: Celery logs it without a traceback.
                signal = JobRefused(error) if status is Outcome.FAILED else JobFailed(error)
        except LeaseLost:
            attempt.outcome = None
            log.warning("celery-lease: job %s: lease lost; %s outcome discarded", attempt.job_id, status.value)
            return None
        if signal is not None:
            raise signal
        return None

    def _incident(self, exc: Exception, attempt: Attempt, kind: str, what: str) -> str:
        """The error stored for ``exc``; its text and traceback go to the log only,
        under the reference that error carries (worker/incident.py)."""
        found = incident(exc, detail=self.settings.error_detail)
        log.error(
            "celery-lease: job %s (%s) attempt %d %s (ref %s)",
            attempt.job_id,
            kind,
            attempt.attempt,
            what,
            found.ref,
            exc_info=exc,
        )
        return found.error
