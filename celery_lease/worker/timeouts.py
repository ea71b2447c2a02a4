"""Kinds' timeouts, written off the heartbeat thread.

The heartbeat thread only renews leases: a timeout's write (a retry, or a failure on
the last attempt) may wait on the job's row, locked by the timed-out handler's own
success transaction, and while it waited no other lease of the process was renewed.
So the heartbeat hands overdue attempts here; a few threads write them (each its own
transition, with a lock timeout, ridden out within the lease), then mark each attempt
lost: its handler stops at its next ``raise_if_cancelled()`` and anything it writes
afterwards is discarded (fenced). The slot of a limited kind is freed by the
transition, once (Pipeline); the handler's end frees nothing more.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from celery_lease.worker.attempt import Attempt

log = logging.getLogger("celery_lease.worker")


class Timeouts:
    #: Timeouts written at once; more wait their turn (each is bounded by its lease).
    THREADS = 2

    def __init__(self, record: Callable[[Attempt], None]) -> None:
        self._record = record
        self._pool: ThreadPoolExecutor | None = None
        self._pid = 0
        self._lock = threading.Lock()

    def submit(self, attempt: Attempt) -> None:
        """Record ``attempt``'s timeout soon; returns at once (heartbeat thread)."""
        with self._lock:
            if self._pool is None or self._pid != os.getpid():
                self._pid = os.getpid()
                self._pool = ThreadPoolExecutor(self.THREADS, thread_name_prefix="celery-lease-timeout")
            self._pool.submit(self._run, attempt)

    def _run(self, attempt: Attempt) -> None:
        try:
            self._record(attempt)
        except Exception:
            log.exception("celery-lease: job %s: cannot record its timeout; the reaper will settle it", attempt.job_id)
        finally:
            attempt.mark_lost()  # stop the handler; its later writes are discarded
