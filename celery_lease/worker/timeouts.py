"""Kinds' timeouts, written off the heartbeat thread, all that are due in one statement.

The rule: the heartbeat thread only renews leases, since a timeout's write may wait on
the job's row (locked by the timed-out handler's own success transaction) and no other
lease of the process would be renewed meanwhile. So the heartbeat hands overdue attempts
here; one thread writes every timeout queued so far as one ``end (background)`` transition (each
row fenced by its attempt's generation, with a lock timeout; retried through an outage while any of
their leases lives), then marks each attempt lost: its handler stops at its next
``raise_if_cancelled()`` and later writes are discarded. The slot of a limited kind is
freed by the transition, once (Pipeline); the handler's end frees nothing more.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from celery_lease.worker.runtime import Drainer

if TYPE_CHECKING:
    from celery_lease.worker.attempt import Attempt

log = logging.getLogger("celery_lease.worker")


class Timeouts(Drainer):
    def __init__(self, record: Callable[[list[Attempt]], None]) -> None:
        super().__init__("celery-lease-timeout")
        #: record(attempts): writes their timeouts, one transition for all.
        self._record = record
        self._queued: list[Attempt] = []

    def submit(self, attempts: Sequence[Attempt]) -> None:
        """Record the timeouts of ``attempts`` soon; returns at once (heartbeat thread)."""
        if not attempts:
            return
        with self._cond:
            self._start()
            self._queued.extend(attempts)
            self._cond.notify()

    def _next(self) -> tuple[list[Attempt] | None, None]:
        taken, self._queued = self._queued, []
        return taken or None, None

    def _drain(self, taken: list[Attempt]) -> None:
        try:
            self._record(taken)
        except Exception:
            log.exception("celery-lease: cannot record the timeouts of %d job(s); the reaper will settle them", len(taken))
        finally:
            for attempt in taken:
                attempt.mark_lost()  # stop the handler; its later writes are discarded
