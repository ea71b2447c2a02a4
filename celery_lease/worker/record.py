"""Recording how an attempt ended: each outcome (succeed, fail, retry, snooze, hand-off,
a kind's timeout) is an :class:`~celery_lease.lifecycle.transition.Ending` written by the
one ``END`` transition, run by the one
:class:`~celery_lease.lifecycle.pipeline.Pipeline`: fenced by the attempt's lease
generation, durable, retried through a database outage within the lease, settled by
asking the server after a lost reply, and followed (errbacks, chain steps, wakeups,
the slot's release) exactly once.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from celery_lease.errors import LeaseLost
from celery_lease.lifecycle import transition as tr
from celery_lease.status import Event
from celery_lease.worker.outcome import TIMED_OUT, backoff

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

    from celery_lease.canvas import Canvas, FollowUp
    from celery_lease.db.store import Store
    from celery_lease.flow.control import FlowControl
    from celery_lease.job import Job
    from celery_lease.kinds import Registry
    from celery_lease.lifecycle.pipeline import Pipeline
    from celery_lease.producer import Producer
    from celery_lease.worker.attempt import Attempt
    from celery_lease.worker.completion import Completer
    from celery_lease.worker.context import JobContext

log = logging.getLogger("celery_lease.worker")


class _SuccessWrites:
    """A success's own part of its transaction: the handler's effects, its children and
    the next chain steps (created with it, atomically), then the chain's plain steps."""

    def __init__(self, record: Recorder, attempt: Attempt, ctx: JobContext, follow_up: FollowUp | None) -> None:
        self._record = record
        self._attempt = attempt
        self._staged = ctx.staged
        self._follow_up = follow_up
        producer = record.producer
        self._children = [producer.job_row(child, payload, options) for child, payload, options in ctx.staged.children]

    def write(self, conn: Connection, rows: Sequence[Mapping[str, Any]]) -> list[Job]:
        store, attempt = self._record.store, self._attempt
        for fn in self._staged.effects:
            fn(conn)
        # A child placed in another run than this job's must respect that run as a
        # submit would: the run is created if new, and a cancelled one takes no job.
        # (This job's own run cannot be cancelled here: cancel_run would have revoked
        # this lease and the fenced update would have matched nothing.)
        runs = {r["run_id"] for r in self._children} - {attempt.run_id, None}
        refused = {run for run in runs if not store.ensure_run(run, connection=conn)}
        for row in [r for r in self._children if r["run_id"] in refused]:
            log.warning(
                "celery-lease: job %s: child %s not created: run %s is cancelled", attempt.job_id, row["kind"], row["run_id"]
            )
        rows_ok = [r for r in self._children if r["run_id"] not in refused]
        # keyed: a child submitted with an idempotency key that already exists is that
        # job, as with submit; only the children actually inserted are returned.
        children = store.insert_jobs(rows_ok, keyed=True, connection=conn) if rows_ok else []
        if self._follow_up is not None:  # the next chain step, callbacks, a chord's body
            children += self._follow_up.write(conn)
        store.log_events(conn, [(c, Event.DISPATCHED, f"child of {attempt.job_id}") for c in children])
        return children

    def send(self) -> None:
        if self._follow_up is not None:
            self._follow_up.send()


class Recorder:
    """The transitions of one worker process's attempts."""

    def __init__(
        self,
        store: Store,
        producer: Producer,
        registry: Registry,
        pipeline: Pipeline,
        completer: Completer,
        *,
        canvas: Canvas | None,
        flow: FlowControl | None,
        eager: bool,
    ) -> None:
        self.store = store
        self.producer = producer
        self.registry = registry
        self.pipeline = pipeline
        self.completer = completer
        self._canvas = canvas
        self._flow = flow
        self._eager = eager

    def succeed(self, ctx: JobContext, attempt: Attempt, result: Any) -> None:
        """Record a success: a plain one (nothing else to commit) through the completer,
        the others in one transaction with their effects, children and chain steps."""
        staged = ctx.staged
        if attempt.is_lost:  # by its own clock too: write nothing more
            raise LeaseLost()
        follow_up = self._canvas.after_success(attempt, result, eager=self._eager) if self._canvas and attempt.canvas else None
        ending = tr.Ending.succeeded(attempt, result, ctx.pending_progress)
        if not (staged.effects or staged.children or follow_up):
            attempt.pending_write = True
            self.completer.add(attempt, ending)
            return
        during = _SuccessWrites(self, attempt, ctx, follow_up)
        self.pipeline.execute(tr.END, tr.ending_params([ending]), attempt=attempt, during=during)

    def fail(self, attempt: Attempt, error: str) -> None:
        self.completer.end(attempt, tr.Ending.failed(attempt, error))

    def retry(self, attempt: Attempt, delay: float, why: str | None = None) -> None:
        """Back to pending, due after ``delay``; ``why`` (the stored form of its error)
        goes to the run's event."""
        self.completer.end(attempt, tr.Ending.retried(attempt, delay, why))

    def hand_off(self, attempt: Attempt, why: str | None = None) -> None:
        """Warm shutdown (or ``why`` else): back to pending at once, attempt not spent,
        wakeup sent."""
        self.completer.end(attempt, tr.Ending.handed_off(attempt, why))
        log.info("celery-lease: job %s: handed off %s", attempt.job_id, why or "on shutdown")

    def snooze(self, attempt: Attempt, seconds: float) -> None:
        """ctx.snooze(): back to pending, due in ``seconds``, attempt not spent. Durable
        and retried through an outage like any end of an attempt: a snooze lost to a crash
        or an outage would leave the job to the reaper, which spends an attempt."""
        self.completer.end(attempt, tr.Ending.snoozed(attempt, seconds))
        log.info("celery-lease: job %s: snoozed for %gs", attempt.job_id, seconds)

    def time_out(self, attempts: Sequence[Attempt]) -> None:
        """``attempts`` ran past their kind's timeout: each retried (or, with no attempt
        left, failed), all in one ``end (background)`` transition, written by the worker's
        timeout thread (worker/timeouts.py)."""
        endings: list[tr.Ending] = []
        for attempt in attempts:
            spec = self.registry.resolve(attempt.kind)
            log.warning(
                "celery-lease: job %s (%s) attempt %d timed out after %ss; stopping it",
                attempt.job_id,
                spec.kind,
                attempt.attempt,
                spec.timeout,
            )
            delay = backoff(attempt.attempt, spec.retry_backoff, spec.retry_backoff_max)
            endings.append(tr.Ending.timed_out(attempt, delay, TIMED_OUT))
        try:
            ended = self.pipeline.execute(tr.END_IN_BACKGROUND, tr.ending_params(endings), attempts=attempts, error=TIMED_OUT)
            moved = {str(r["id"]) for r in ended}
        except LeaseLost:
            moved = set()
        for attempt in attempts:
            if attempt.job_id not in moved:
                attempt.mark_lost()
                log.info("celery-lease: job %s: lease already lost at its timeout", attempt.job_id)
