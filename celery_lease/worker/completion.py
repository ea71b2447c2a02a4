"""Plain successes written in batches: one fenced statement for many attempts.

A success with nothing else to commit (no effects, children or run events) does not
need the handler to wait: the attempt's outcome is final once the body has returned,
and its write stays fenced by the lease generation. So the body returns at once and
this thread writes every success queued within LINGER seconds in one ``complete_jobs``
statement. If the process dies before the write, the job is still running under its
lease and the reaper requeues it, exactly as if it had died a moment earlier inside
the body. Warm exits flush (``worker_process_shutdown``).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from celery_lease.db import queries as q
from celery_lease.errors import DatabaseUnavailable, LeaseLost
from celery_lease.producer import refused_value
from celery_lease.worker.attempt import BLIP_WAITS

if TYPE_CHECKING:
    from celery_lease.db.store import Store
    from celery_lease.worker.attempt import Attempt

log = logging.getLogger("celery_lease.worker")

#: The stored error of a success whose values the database refused.
UNSTORABLE_RESULT = "result could not be stored"
#: Queued by Completer.flush: write what is gathered now.
_FLUSH = object()


class Completer:
    LINGER = 0.002
    MAX_BATCH = 64

    def __init__(self, store: Store, on_written: Callable[[Attempt], None] | None = None) -> None:
        self._store = store
        #: Called for each attempt once its success is written (or given up on).
        self._on_written = on_written
        self._queue: queue.Queue[Any] = queue.Queue()
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
        try:
            self._record(batch)
        finally:
            for attempt, _, _ in batch:
                attempt.pending_write = False
                if self._on_written is not None:
                    self._on_written(attempt)

    def _record(self, batch: list[tuple[Attempt, Any, Any]]) -> None:
        waits = iter(BLIP_WAITS)
        while True:
            # While the database is unreachable, try again with the attempts whose
            # leases have not lapsed; the others are left to the reaper, exactly as
            # if their process had died a moment earlier inside the body.
            live = [item for item in batch if not item[0].is_lost]
            if not live:
                return
            try:
                done = self._store.complete_many(self._params(live), len(live))
                break
            except DatabaseUnavailable:
                log.warning("celery-lease: database unavailable; %d success(es) wait within their leases", len(live))
                time.sleep(next(waits, BLIP_WAITS[-1]))
            except Exception as exc:
                if not refused_value(exc):
                    log.exception("celery-lease: cannot record %d successes; the reaper will requeue them", len(live))
                    return
                # A value the database refused (values are checked before they are
                # queued, so this is a last line of defence): one row must not cost the
                # others.
                log.exception("celery-lease: a batch of %d successes was refused; writing them one by one", len(live))
                if len(live) > 1:
                    for item in live:
                        self._record([item])
                else:
                    self._refuse(live[0][0])
                return
        for attempt, result, progress in live:
            if attempt.job_id in done:
                continue
            # Missing from the batch's result: lost, or a row the batch statement did
            # not re-qualify after a concurrent update (a renewal) changed it. The single
            # fenced statement decides which, so no success is discarded by a race.
            if self._fenced_alone(attempt, q.complete_job(), new_result=result, new_progress=progress):
                continue
            log.warning("celery-lease: job %s: lease lost; success discarded", attempt.job_id)

    def _fenced_alone(self, attempt: Attempt, stmt, **params: Any) -> bool:
        """One fenced outcome in its own durable transaction; False when the lease is lost."""
        try:
            self._store.transaction(self._store.durable, lambda conn: attempt.fenced(self._store, conn, stmt, **params))
            return True
        except LeaseLost:
            return False

    def _refuse(self, attempt: Attempt) -> None:
        """The database refused this success's values: the job ends failed (fenced),
        never stuck running nor silently dropped."""
        try:
            if not self._fenced_alone(attempt, q.fail_job(), new_error=UNSTORABLE_RESULT):
                log.warning("celery-lease: job %s: lease lost; refused success discarded", attempt.job_id)
            else:
                log.error("celery-lease: job %s: %s", attempt.job_id, UNSTORABLE_RESULT)
        except Exception:
            log.exception("celery-lease: job %s: cannot record its refused success; the reaper will requeue it", attempt.job_id)

    @staticmethod
    def _params(batch: list[tuple[Attempt, Any, Any]]) -> dict[str, Any]:
        params: dict[str, Any] = {}
        for i, (attempt, result, progress) in enumerate(batch):
            params.update(
                {
                    f"job_id_{i}": attempt.job_id,
                    f"generation_{i}": attempt.generation,
                    f"new_result_{i}": result,
                    f"new_progress_{i}": progress,
                }
            )
        return params
