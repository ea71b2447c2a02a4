"""A delivery that claims what is due of its kind (PostgreSQL): every kind whose wakeups
are coalesced (broker/waking.py) and every ``batch=`` kind.

:meth:`ManyJobClaims.begin` claims up to :meth:`ManyJobClaims.size` due jobs of the kind
and queue in ONE statement (lifecycle.many_claim), each with its own attempt, lease and
fencing token, and wakes the kind again at once when the claim came back full.
:meth:`ManyJobClaims.run` runs them one after another through the single job's path
(WorkerState.execute), then claims again while its claims come back full
(CLAIM_AGAIN_SECONDS): a backlog costs no message per claim. Rule: a job waiting its turn
keeps its lease (the heartbeat renews every lease of the process); one whose lease is
lost while it waits, or met by a warm stop, never starts. docs/decisions.md, "Many jobs
per claim".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from celery.exceptions import Retry

from celery_lease import tracing
from celery_lease.broker.waking import PUSHED, RELEASED
from celery_lease.errors import DatabaseUnavailable, JobFailed, JobRefused, LeaseLost
from celery_lease.flow.store import declared_limits
from celery_lease.lifecycle.many_claim import claim_many
from celery_lease.lifecycle.owner import owner_of
from celery_lease.worker import shutdown
from celery_lease.worker.attempt import Attempt, HeldMark
from celery_lease.worker.outcome import Outcome

if TYPE_CHECKING:
    from celery_lease.kinds import JobKind
    from celery_lease.worker.events import ManyClaimTasks

log = logging.getLogger("celery_lease.worker")

_CANCELLED = "cancelled"

#: A kind with no ``batch=``: a claim takes about this many seconds of its bodies ...
CLAIM_SECONDS = 0.05
#: ... and at most this many jobs (ManyJobClaims.size).
DEFAULT_CAP = 100
#: Seconds a delivery whose claims come back full goes on claiming, from its first run
#: (_claim_again): under a backlog a pool process skips a message, its mark and Celery's
#: round per claim; a delivery of another kind waits for this process about this long.
CLAIM_AGAIN_SECONDS = 1.0
#: A kind whose attempts took at most this long here holds its wakeup's mark (_hold):
#: short bodies, so the mark's lifetime from its renewal (waking.HOLD_TTL_MS) covers a
#: claim's worth of them.
HOLD_BODY_SECONDS = 0.005
#: A holder whose count moved claims no sooner than this after its last look: submits
#: gather for a claim of several jobs instead of one per submit (River's fetch cooldown,
#: in small); bodies that ran that long already cost no wait.
HOLD_PAUSE_SECONDS = 0.01


class ManyJobClaims:
    """The many-job claims of one worker process's deliveries."""

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

    def begin(self, job_id: str, spec: JobKind, hostname: str | None, routing_key: Any = None) -> Attempt | None:
        """Claim the delivery's jobs; its lead attempt (``attempt.claimed_together`` holds them all),
        or None when nothing was claimed. Every delivery claims, also one whose job runs
        here: submits may have left their jobs to its claim (broker/waking.py), and the job it
        names may have been reaped and be due again (nothing here can tell). Its wakeup's
        mark (``routing_key``: as delivered) goes before the claim, or is held (_hold)."""
        owner = owner_of(hostname)
        sent_at = time.monotonic()
        waking = self._state.producer.waking
        held = self._hold(spec, routing_key)
        try:
            attempts, full = self._claim(job_id, spec, owner, holding=held is not None)
        except BaseException:
            if held is not None:  # no claim read what was counted: the next submit publishes
                waking.let_go(held[0])
            raise
        if not attempts and held is not None and waking.release(*held) != RELEASED:
            # Submits came since the push (or the mark went): let go, and claim once more.
            waking.let_go(held[0])
            held = None
            attempts, full = self._claim(job_id, spec, owner, again=True)
        if not attempts:
            return None
        if held is not None:  # (after the claim: a lone job's start waits for no reply)
            waking.renew(held[0])
        lead = attempts[0]
        lead.claimed_together = attempts
        lead.claims_again_for = owner if full else None
        lead.holds_mark = None if held is None else HeldMark(owner, *held, sent_at)
        if spec.timeout is not None:
            lead.deadline = sent_at + spec.timeout
        log.info("celery-lease: job %s (%s): claimed a batch of %d", job_id, spec.kind, len(attempts))
        return lead

    def _hold(self, spec: JobKind, routing_key: Any) -> tuple[str, str] | None:
        """Before the first claim: (the mark, the count it holds from) if this delivery
        holds its wakeup's mark, else None, the mark deleted. Held for a kind of short
        bodies here (one until one ran: a lone job, or a long one, holds no one back) with
        no limit (its jobs are woken as slots free): while it holds, submits publish
        nothing and it claims what they counted once its jobs ran (run). It holds from
        PUSHED, unread (broker/waking.py): a delivery that did not come from that push (a
        sweeper's, a full claim's) or a mark gone only cost a claim more."""
        waking = self._state.producer.waking
        key = waking.mark_of(spec.task, routing_key)
        if key is None:
            return None
        took = self._took.get(spec.kind)
        limited = self._state.flow is not None and self._state.flow.limited(spec)
        if spec.batch is not None or took is None or took > HOLD_BODY_SECONDS or limited:
            waking.let_go(key)
            return None
        return key, PUSHED

    def _claim(
        self, job_id: str, spec: JobKind, owner: str, *, again: bool = False, holding: bool = False
    ) -> tuple[list[Attempt], bool]:
        """One many-job claim for ``owner``: the attempts to run (``job_id``'s first: the
        delivery's own) and whether to claim again once they ran: it came back full (more
        is due, and was woken) and no limit bounds the kind (a limited kind's jobs are
        woken as its slots and windows free, which its successes still waiting for the
        completer have not). A claim ``again`` that finds nothing says nothing of the
        delivery (its jobs ran). ``holding`` its mark, a full claim's wakeup is pushed
        whatever the mark (a counted one would not go)."""
        state = self._state
        sent_at = time.monotonic()
        params = {"job_id": job_id, "wakeup_task": spec.task, "owner": owner, "n": self.size(spec)}
        limited = state.flow is not None and state.flow.limited(spec)
        for _ in range(2):
            if limited:
                params.update(declared_limits(spec.kind, spec.limits))
            # A re-run of the claim after a lost reply adopts the rows its first try took, by
            # the claim's token, never other rows (lifecycle.many_claim.claim_many).
            found = claim_many(state.store, params, limited=limited)
            if limited or not (found and found[0].get("overridden")) or state.flow is None:
                break
            # Refused by an override this process had not read: claimed on the limited path.
            limited = state.flow.limited(spec, fresh=True)
        rows = [r for r in found if r["id"] is not None]  # (nothing claimed: one row of NULLs)
        paused = bool(found and found[0]["paused"])
        if limited and found and not paused:
            self._limited_follow_ups(job_id, spec, found[0], any(str(r["id"]) == job_id for r in rows))
            if not rows and found[0]["next_id"] is not None:
                # A limit refused every row picked (now held), and more are due: woken as
                # a full claim's rest is, so the held rows do not hide them.
                self._wake(spec, found[0]["next_id"], found[0]["next_queue"])
        if not rows:
            if not again:
                self._nothing_claimed(job_id, spec, paused=paused)
            return [], False
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
            self._wake(spec, following, rows[0]["queue"], coalesce=not holding)
        for row in rows:
            if row["status"] == _CANCELLED:
                log.info("celery-lease: job %s: its run is cancelled; cancelled, not started", row["id"])
                state.pipeline.claim_cancelled(row)
        if any(a.late_to_start for a in attempts):
            for a in attempts:
                state._hand_off_late(a)
            return [], False
        return attempts, following is not None and not limited

    def _limited_follow_ups(self, job_id: str, spec: JobKind, first: dict[str, Any], own: bool) -> None:
        """A limited kind's many-job claim: what its rate window asks for, and a delivery whose own
        job it did not claim (``own``) followed up as a single limited claim's
        (FlowControl.many_claimed). Never fails the delivery: what is not woken is the
        sweeper's to recover."""
        try:
            self._state.flow.many_claimed(job_id, spec, first, own)
        except Exception:
            what = "wakeups after its batch claim not sent; the sweeper will"
            log.warning("celery-lease: job %s (%s): %s", job_id, spec.kind, what, exc_info=True)

    def _nothing_claimed(self, job_id: str, spec: JobKind, *, paused: bool) -> None:
        """A paused kind's delivery is held for its resume (FlowControl.hold marks it);
        any other is a duplicate, or found its jobs taken by other many-job claims: skipped with
        no statement beyond the claim."""
        state = self._state
        if paused and state.flow is not None:
            state.flow.hold(job_id, spec)
        log.info("celery-lease: job %s: duplicate or not claimable delivery; skipped", job_id)

    def _wake(self, spec: JobKind, job_id: str, queue: str | None, *, coalesce: bool = True) -> None:
        try:
            # Coalesced as a submit's: a wakeup of the kind already on its way takes the rest.
            self._state.producer.publish_wakeups([{"id": job_id, "task": spec.task, "queue": queue}], coalesce=coalesce)
        except Exception:
            log.warning("celery-lease: %s: the rest of a full batch not woken; the sweeper will", spec.kind)

    # --- the body --------------------------------------------------------------------------

    def run(
        self, spec: JobKind, lead: Attempt, on_progress: Callable[[Any], None] | None, tasks: ManyClaimTasks | None = None
    ) -> Any:
        """Run every attempt ``lead``'s claim took, one after another; returns the lead's
        value and raises the lead's Retry / JobRefused / JobFailed, after all of them
        (Celery reports the delivery's task as its own job's outcome; ``tasks`` sends
        the task events of the others, when the worker sends events)."""
        assert lead.claimed_together is not None
        began = time.monotonic()
        batch = lead.claimed_together
        try:
            value, signal = self._run_batch(spec, lead, batch, on_progress, tasks)
            while (later := self._next_claim(spec, lead, began)) is not None:
                try:
                    self._run_batch(spec, lead, later, on_progress, tasks)
                finally:
                    for a in later:  # a later claim's: no task_postrun ends them (WorkerState.end)
                        self._done(a)
        finally:
            if lead.holds_mark is not None:  # left by an exception: its count lapses to the next claim
                self._state.producer.waking.let_go(lead.holds_mark.key)
                lead.holds_mark = None
            if tasks is not None:
                tasks.close()
        if signal is not None:
            raise signal
        return value

    def _run_batch(
        self,
        spec: JobKind,
        lead: Attempt,
        batch: list[Attempt],
        on_progress: Callable[[Any], None] | None,
        tasks: ManyClaimTasks | None,
    ) -> tuple[Any, Exception | None]:
        """Run the attempts of one claim in turn; the lead's (value, signal), when it is one."""
        value: Any = None
        signal: Exception | None = None
        for a in batch:
            if a is not lead and not self._may_start(spec, a):
                continue
            started = time.monotonic()
            if a is lead:
                value, signal = self._execute(spec, a, on_progress)
            else:
                self._execute_own_task(spec, a, tasks)
            self._measured(spec, time.monotonic() - started)
            # Its body is over (a success may still wait for the completer): no renewal from
            # here on (one that ran after the success committed logged a false "lease lost
            # (cancelled or reaped)").
            self._done(a)
        return value, signal

    def _next_claim(self, spec: JobKind, lead: Attempt, began: float) -> list[Attempt] | None:
        """The next claim of a delivery once its jobs ran, or None when it is done. For
        CLAIM_AGAIN_SECONDS from its first run and not on a warm stop: again while its
        claims come back full (the process takes what is due without a message per claim;
        the full claim woke the kind for the others); holding its mark, again for the
        submits counted since its last look, after HOLD_PAUSE_SECONDS for more to gather.
        A holder out of time (or stopping, or whose mark went) lets go and claims once
        more: what was counted before it let go is read by that claim (on a warm stop its
        jobs are handed back, _may_start). Its jobs run as the claim's other jobs do, with
        task events of their own."""
        over = shutdown.requested() or time.monotonic() - began >= CLAIM_AGAIN_SECONDS
        waking = self._state.producer.waking
        if lead.claims_again_for is not None and not over:
            held = lead.holds_mark
            if held is not None:  # a look before each claim keeps the mark
                now = waking.look(held.key)
                lead.holds_mark = None if now is None else held._replace(seen=now, at=time.monotonic())
            return self._claim_again(spec, lead, lead.claims_again_for)
        if lead.holds_mark is None:
            return None
        owner, key, seen, looked = lead.holds_mark
        if not over:
            now = waking.release(key, seen)
            if now == RELEASED:
                lead.holds_mark = None
                return None
            if now is not None:
                time.sleep(max(0.0, HOLD_PAUSE_SECONDS - (time.monotonic() - looked)))
                now = waking.look(key)
            if now is not None:
                lead.holds_mark = HeldMark(owner, key, now, time.monotonic())
                return self._claim_again(spec, lead, owner)
        lead.holds_mark = None
        waking.let_go(key)
        return self._claim_again(spec, lead, owner)

    def _claim_again(self, spec: JobKind, lead: Attempt, owner: str) -> list[Attempt] | None:
        """A claim after the delivery's jobs ran: its attempts; None if it failed (the
        delivery is done: the jobs ran already, so it must not fail for it; the full
        claim's wakeup, the mark's lapse or the sweeper take the rest)."""
        try:
            attempts, full = self._claim(lead.job_id, spec, owner, again=True, holding=lead.holds_mark is not None)
        except Exception:
            log.warning("celery-lease: %s: a claim after its jobs ran failed; its wakeups will", spec.kind, exc_info=True)
            return None
        lead.claims_again_for = owner if full else None
        return attempts

    def _execute(self, spec: JobKind, a: Attempt, on_progress: Callable[[Any], None] | None) -> tuple[Any, Exception | None]:
        """Run one attempt of the claim: its value, or the Retry / JobRefused / JobFailed
        it raised once its outcome was recorded."""
        try:
            with tracing.current(a):
                return self._state.execute(spec, a, on_progress, one=True), None
        except (Retry, JobRefused, JobFailed) as exc:  # recorded already
            return None, exc
        except (LeaseLost, DatabaseUnavailable):
            log.warning("celery-lease: job %s: outcome not written; the reaper will requeue it", a.job_id)
            return None, None

    def _execute_own_task(self, spec: JobKind, a: Attempt, tasks: ManyClaimTasks | None) -> None:
        """A job of the claim other than the delivery's: an attempt span and task events
        of its own (the delivery's come from task_prerun / task_postrun and Celery)."""
        clock = tracing.clock()
        if clock is not None:
            tracing.start_attempt(a, a.queue or spec.queue, clock, None)
        if tasks is not None:
            tasks.started(a)
        began = time.monotonic()
        try:
            value, raised = self._execute(spec, a, None)
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
        """Whether the next attempt of a many-job claim starts: not once its lease is lost while it
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
        """``a``'s body is over (its success may still wait for the completer), or it
        never starts: no more renewals."""
        self._state.heartbeat.remove(a)
