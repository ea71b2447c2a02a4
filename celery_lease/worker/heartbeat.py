"""The heartbeat: renews every lease this process holds, in one statement per round.

One daemon thread per process. A round runs every third of the shortest lease held,
and at once when an attempt with a shorter lease arrives or a cancel notice comes in.
A renewal that fails on a database error is retried every second. Renewals run on a
connection of their own with short timeouts; whatever the heartbeat does, an attempt
whose renewal is not confirmed in time counts as lost by its own clock
(:attr:`Attempt.is_lost`), so its handler stops writing before another attempt can be
claimed.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from celery_lease import cancel_notice

if TYPE_CHECKING:
    from celery_lease.db.store import Store
    from celery_lease.worker.attempt import Attempt

log = logging.getLogger("celery_lease.worker")


class Heartbeat:
    RETRY_SECONDS = 1.0

    def __init__(self, store: Store, broker_url: str | None, on_timeout: Callable[[Attempt], None] | None = None) -> None:
        self._store = store
        self._broker_url = broker_url
        #: Called (from this thread) for an attempt past its kind's timeout.
        self._on_timeout = on_timeout
        #: Keyed by (job, generation): a second attempt of one job in this process never
        #: hides the first from lost-lease detection.
        self._attempts: dict[tuple[str, int], Attempt] = {}
        self._lock = threading.Lock()
        #: One renewal at a time on the heartbeat's single connection (the thread's
        #: rounds and a handler's ctx.heartbeat()).
        self._renewing = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = 0
        #: Seconds the last renewal statement took (for metrics).
        self.last_latency = 0.0

    def add(self, attempt: Attempt) -> None:
        with self._lock:
            shortest = min((a.lease_seconds for a in self._attempts.values()), default=None)
            self._attempts[attempt.key] = attempt
            if self._thread is None or self._pid != os.getpid():
                self._pid = os.getpid()
                self._thread = threading.Thread(target=self._loop, name="celery-lease-heartbeat", daemon=True)
                self._thread.start()
                cancel_notice.listen(self._broker_url, self.wake)  # sooner than the next round
            elif shortest is None or attempt.lease_seconds < shortest or attempt.deadline is not None:
                # The sleeping round was timed for longer leases (or no deadline):
                # re-time it now.
                self._wake.set()

    def remove(self, attempt: Attempt) -> None:
        with self._lock:
            if self._attempts.get(attempt.key) is attempt:
                del self._attempts[attempt.key]

    def wake(self) -> None:
        """Renew now, e.g. when told by a message that a job may have been cancelled."""
        self._wake.set()

    def renew_now(self, attempt: Attempt) -> bool:
        # A round stuck on a connection that stopped answering must not hold the
        # handler past the moment its lease lapses by its own clock.
        if self._renewing.acquire(timeout=max(0.0, attempt.lapses_at - time.monotonic())):
            try:
                self._renew_held([attempt])
            finally:
                self._renewing.release()
        return not attempt.is_lost

    def _interval(self) -> float:
        with self._lock:
            leases = [a.lease_seconds for a in self._attempts.values()]
            deadlines = [a.deadline for a in self._attempts.values() if a.deadline is not None and not a.lost.is_set()]
        interval = min(leases) / 3 if leases else 1.0
        if deadlines:
            interval = min(interval, max(0.0, min(deadlines) - time.monotonic()))
        return interval

    def _loop(self) -> None:
        delay = self._interval()
        while True:
            self._wake.wait(delay)
            self._wake.clear()
            self._time_out_overdue()
            with self._lock:
                attempts = [a for a in self._attempts.values() if not a.is_lost]
            ok = self._renew(attempts) if attempts else True
            delay = self._interval() if ok else min(self.RETRY_SECONDS, self._interval())

    def _time_out_overdue(self) -> None:
        now = time.monotonic()
        with self._lock:
            overdue = [a for a in self._attempts.values() if a.deadline is not None and now >= a.deadline and not a.is_lost]
        for a in overdue:
            try:
                if self._on_timeout is not None:
                    self._on_timeout(a)
            except Exception:
                log.exception("celery-lease: job %s: cannot record its timeout", a.job_id)
            finally:
                a.mark_lost()  # stop the handler; its later writes are discarded

    def _renew(self, attempts: list[Attempt]) -> bool:
        with self._renewing:
            return self._renew_held(attempts)

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
        now = time.monotonic()
        self.last_latency = now - started
        for a in attempts:
            if a.key in held:
                # Held but not renewed: its row was locked (this process's own success
                # transaction, most likely): not lost, and not waited for.
                if held[a.key]:
                    a.renewed_at = started
                continue
            a.mark_lost()
            with self._lock:
                still_running = self._attempts.get(a.key) is a
            # An attempt that completed while the statement ran simply had nothing left
            # to renew; only a running one has really lost its lease.
            if still_running:
                log.warning("celery-lease: job %s: lease lost (cancelled or reaped)", a.job_id)
        return True
