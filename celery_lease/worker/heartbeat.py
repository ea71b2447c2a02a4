"""The heartbeat: renews every lease this process holds, in one statement per round.

One daemon thread per process (worker/runtime.py). A round runs every third of the
shortest lease held, and at once when an attempt with a shorter lease arrives or a
cancel notice comes in. A renewal that fails on a database error is retried after
RETRY_SECONDS. Renewals run on a connection of their own with short timeouts, never the
broker's; whatever the heartbeat does, an attempt whose renewal is not confirmed in time
counts as lost by its own clock (:attr:`Attempt.is_lost`), so its handler stops writing
before another attempt can be claimed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from celery_lease.broker import cancel_notice
from celery_lease.worker.runtime import Drainer

if TYPE_CHECKING:
    from celery_lease.db.store import Store
    from celery_lease.worker.attempt import Attempt

log = logging.getLogger("celery_lease.worker")


class Heartbeat(Drainer):
    #: Gap before the next try after a renewal failed on a database error.
    RETRY_SECONDS = 0.5
    MIN_GAP = 0.25
    #: Share of its lease by which an attempt's renewal may come after it is due rather
    #: than wake the loop early (renewals are due at a third of a lease; the attempt
    #: counts its lease lost at LAPSE_SHARE of it, far later).
    LATE_SHARE = 0.05

    def __init__(
        self,
        store: Store,
        broker_url: str | None,
        notice_channel: str | None = None,
        on_timeout: Callable[[list[Attempt]], None] | None = None,
    ) -> None:
        super().__init__("celery-lease-heartbeat")
        self._store = store
        self._broker_url = broker_url
        self._notice_channel = notice_channel
        #: Called (from this thread, must not block) with the attempts past their kind's timeout.
        self._on_timeout = on_timeout
        #: Keyed by (job, generation): a second attempt of one job in this process never
        #: hides the first from lost-lease detection.
        self._attempts: dict[tuple[str, int], Attempt] = {}
        #: One renewal at a time on the heartbeat's single connection (the thread's
        #: rounds and a handler's ctx.heartbeat()).
        self._renewing = threading.Lock()
        #: A wake asks for a renewal now (a cancel notice), not just for re-timing the
        #: loop (an attempt arrived).
        self._urgent = False
        #: A round is spaced from the last by at least MIN_GAP (a row skipped because it
        #: was locked keeps its old renewal time and would be due at once again).
        self._not_before = 0.0
        #: Monotonic time the sleeping loop wakes at on its own (inf: until woken).
        #: An attempt due before it wakes the loop; one due later is found by that
        #: wake-up anyway, so a steady stream of jobs costs no thread switch per job.
        self._wakes_at = 0.0
        #: While no attempt is held, the loop still wakes this often (the shortest lease
        #: seen, over 3), so the next attempt's add rarely has to wake it.
        self._idle_gap: float | None = None
        #: This process's cancel-notice listener (None until started, or on a broker without
        #: notices: neither Redis nor AMQP).
        self.notices: cancel_notice.Listener | None = None

    def add(self, attempt: Attempt) -> None:
        with self._cond:
            self._attempts[attempt.key] = attempt
            self._idle_gap = min(self._idle_gap or float("inf"), attempt.lease_seconds / 3)
            if self._start():
                # Sooner than the next round, for notices naming a job held here.
                self.notices = cancel_notice.listen(
                    self._broker_url, self.wake, held=self.held_jobs, channel_name=self._notice_channel
                )
            elif self._due_of(attempt) < self._wakes_at - attempt.lease_seconds * self.LATE_SHARE:
                # Re-time the sleeping loop (a shorter lease or a deadline now comes
                # first); it renews nothing until something is due.
                self._cond.notify()
            if self.notices is not None:
                self.notices.ensure_running()  # a listener that ended listens again

    def remove(self, attempt: Attempt) -> None:
        with self._cond:
            if self._attempts.get(attempt.key) is attempt:
                del self._attempts[attempt.key]

    def held_jobs(self) -> set[str]:
        """The ids of the jobs whose leases this process holds (and has not lost)."""
        with self._cond:
            return {a.job_id for a in self._attempts.values() if not a.is_lost}

    def wake(self) -> None:
        """Renew now, e.g. when told by a message that a job may have been cancelled."""
        with self._cond:
            self._urgent = True
            self._cond.notify()

    def renew_now(self, attempt: Attempt) -> bool:
        # A round stuck on a connection that stopped answering must not hold the
        # handler past the moment its lease lapses by its own clock.
        if self._renewing.acquire(timeout=max(0.0, attempt.lapses_at - time.monotonic())):
            try:
                self._renew_held([attempt])
            finally:
                self._renewing.release()
        return not attempt.is_lost

    @staticmethod
    def _due_of(attempt: Attempt) -> float:
        """When ``attempt`` next needs the loop: its renewal (a third of a lease after its
        last confirmed renewal) or its timeout deadline, whichever comes first."""
        due = attempt.renewed_at + attempt.lease_seconds / 3
        return due if attempt.deadline is None else min(due, attempt.deadline)

    def _next(self) -> tuple[bool | None, float | None]:
        """A round when a wake asked for one or something is due, else the wait until the
        next thing to do, or an idle gap (None before any attempt). An arriving attempt
        only re-times it (a renewal right after its claim is wasted)."""
        urgent, self._urgent = self._urgent, False
        now = time.monotonic()
        due = min((self._due_of(a) for a in self._attempts.values() if not a.is_lost), default=None)
        if due is None and self._idle_gap is not None:
            due = now + self._idle_gap
        self._wakes_at = float("inf") if due is None else due
        at = None if due is None else max(due, self._not_before)
        if urgent or (at is not None and at <= now):
            return True, None
        return None, None if at is None else at - now

    def _drain(self, _: bool) -> None:
        self._time_out_overdue()
        with self._cond:
            attempts = [a for a in self._attempts.values() if not a.is_lost]
        with self._renewing:
            ok = self._renew_held(attempts) if attempts else True
        self._not_before = time.monotonic() + (self.MIN_GAP if ok else self.RETRY_SECONDS)

    def _time_out_overdue(self) -> None:
        """Hand the attempts past their kind's timeout to ``on_timeout``, all at once, each
        once. It must not block: this thread only renews (the write runs on
        worker/timeouts.py's thread, which stops the handlers once it landed); until then
        their leases are renewed as any other."""
        now = time.monotonic()
        with self._cond:
            overdue = [a for a in self._attempts.values() if a.deadline is not None and now >= a.deadline and not a.is_lost]
            for a in overdue:
                a.deadline = None
        if not overdue:
            return
        try:
            if self._on_timeout is not None:
                self._on_timeout(overdue)  # every timeout due now: one write
                return
        except Exception:
            log.exception("celery-lease: cannot hand over the timeouts of %d job(s)", len(overdue))
        for a in overdue:
            a.mark_lost()  # stop the handler; the reaper settles the job

    def _renew_held(self, attempts: list[Attempt]) -> bool:
        # The database set each new expiry after this instant: counting from it, the
        # attempt's own deadline never falls after the one in the table.
        started = time.monotonic()
        try:
            held = self._store.renew([a.key for a in attempts])
        except Exception:
            # Each attempt gives up by its own clock (Attempt.is_lost) once the renewal
            # it needs is too late; until then, retry.
            log.warning("celery-lease: heartbeat failed; retrying within the lease", exc_info=True)
            return False
        for a in attempts:
            if a.key in held:
                # Held but not renewed: its row was locked (this process's own success
                # transaction, most likely): not lost, and not waited for.
                if held[a.key]:
                    a.renewed_at = started
                continue
            a.mark_lost()
            with self._cond:
                still_running = self._attempts.get(a.key) is a
            # An attempt that completed while the statement ran simply had nothing left
            # to renew; only a running one has really lost its lease.
            if still_running:
                log.warning("celery-lease: job %s: lease lost (cancelled or reaped)", a.job_id)
        return True
