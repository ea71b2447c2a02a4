"""Where a plain success (nothing else to commit) is written: the process's one
:class:`Completer`, for single jobs and many-job claims alike.

:class:`BackgroundCompleter` (PostgreSQL): the body returns at once and its success waits at
most a few milliseconds for this thread's ``end_jobs`` of every success gathered
(one durable commit for all: the pipeline's END, whose Landing settles a lost reply). The
write is fenced by the generation; a row
missing from the result is re-checked alone (:func:`confirm`); a success whose lease
lapsed only by its own clock (the database away) is still written. A process that dies
first leaves the job running under its lease, for the reaper. :class:`InlineCompleter`
(SQLite) writes each at once. Warm exits flush.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from celery_lease.db.refused import refused_value
from celery_lease.errors import LeaseLost
from celery_lease.lifecycle import transition as tr
from celery_lease.worker.runtime import Drainer

if TYPE_CHECKING:
    from celery_lease.db.store import Store
    from celery_lease.lifecycle.pipeline import Pipeline
    from celery_lease.worker.attempt import Attempt

log = logging.getLogger("celery_lease.worker")

#: The stored error of a success whose values the database refused.
UNSTORABLE_RESULT = "result could not be stored"

Item = tuple["Attempt", Any, Any]


def successes(items: list[Item]) -> list[tr.Ending]:
    """The endings of these successes."""
    return [tr.Ending.succeeded(a, r, p) for a, r, p in items]


def write_successes(pipeline: Pipeline, items: list[Item], write: Callable[[list[Item]], set[str]]) -> None:
    """Write many plain successes with ``write`` (one statement; returns the ids it
    wrote): the one algorithm of the completer and of a many-job claim's delivery. A success
    whose lease is known lost is not written; one missing from the result is re-checked
    alone (confirm); a group of successes with a value the database refused is written one by one,
    and a refused success ends its job failed (refuse)."""
    live = [item for item in items if not item[0].known_lost]
    if not live:
        return
    try:
        done = write(live)
    except Exception as exc:
        if not refused_value(exc):
            raise
        # Values are checked before they are queued, so this is a last line of
        # defence: one row must not cost the others.
        if len(live) == 1:
            refuse(pipeline, live[0][0])
            return
        log.exception("celery-lease: a batch of %d successes was refused; writing them one by one", len(live))
        for item in live:
            write_successes(pipeline, [item], write)
        return
    confirm(pipeline, live, done)


def confirm(pipeline: Pipeline, items: list[Item], done: set[str]) -> None:
    """Re-check alone each success missing from ``done``: lost, or a row the many-row
    statement did not re-qualify after a concurrent update (a renewal) changed it. The
    single fenced END decides which, so no success is discarded by a race."""
    for attempt, result, progress in items:
        if attempt.job_id in done or attempt.known_lost:
            continue
        try:
            pipeline.execute(tr.END, tr.ending_params(successes([(attempt, result, progress)])), attempt=attempt)
        except LeaseLost:
            log.warning("celery-lease: job %s: lease lost; success discarded", attempt.job_id)


def refuse(pipeline: Pipeline, attempt: Attempt) -> None:
    """The database refused this success's values: the job ends failed (fenced), never
    stuck running nor silently dropped."""
    try:
        ending = tr.Ending.failed(attempt, UNSTORABLE_RESULT)
        pipeline.execute(tr.END, tr.ending_params([ending]), attempt=attempt, error=UNSTORABLE_RESULT)
        log.error("celery-lease: job %s: %s", attempt.job_id, UNSTORABLE_RESULT)
    except LeaseLost:
        log.warning("celery-lease: job %s: lease lost; refused success discarded", attempt.job_id)
    except Exception:
        log.exception("celery-lease: job %s: cannot record its refused success; the reaper will requeue it", attempt.job_id)


class Completer(Protocol):
    """Takes plain successes; ``attempt.pending_write`` is cleared once each is written
    or given up on."""

    def add(self, attempt: Attempt, result: Any, progress: Any) -> None:
        """Hand over a success; the inline completer writes it before returning (and
        raises LeaseLost or DatabaseUnavailable as the write did)."""

    def flush(self, timeout: float = 10.0) -> None:
        """Write every waiting success now (warm exit)."""


def completer_for(store: Store, pipeline: Pipeline) -> Completer:
    return BackgroundCompleter(pipeline) if store.capabilities.background_completions else InlineCompleter(pipeline)


class InlineCompleter:
    """Each success written at once, in its own durable transaction."""

    def __init__(self, pipeline: Pipeline) -> None:
        self._pipeline = pipeline

    def add(self, attempt: Attempt, result: Any, progress: Any) -> None:
        try:
            ending = tr.Ending.succeeded(attempt, result, progress)
            self._pipeline.execute(tr.END, tr.ending_params([ending]), attempt=attempt)
        finally:
            attempt.pending_write = False

    def flush(self, timeout: float = 10.0) -> None:
        pass


class BackgroundCompleter(Drainer):
    #: Seconds the oldest waiting success waits for others to share its statement.
    LINGER = 0.002
    MAX_PER_WRITE = 64

    def __init__(self, pipeline: Pipeline) -> None:
        super().__init__("celery-lease-completer")
        self._pipeline = pipeline
        #: Successes waiting, oldest first; the oldest arrived at _since.
        self._pending: list[Item] = []
        self._since = 0.0
        #: Successes taken by this thread and not yet written.
        self._inflight = 0
        self._flushing = False
        #: The thread waits with no timeout (nothing pending): an arrival must wake it.
        self._idle = False

    def add(self, attempt: Attempt, result: Any, progress: Any) -> None:
        with self._cond:
            self._start()
            if not self._pending:
                self._since = time.monotonic()
            self._pending.append((attempt, result, progress))
            # A thread already timing a write finds this one when it wakes: no wake-up
            # per job.
            if self._idle or len(self._pending) >= self.MAX_PER_WRITE:
                self._cond.notify_all()  # the thread (a flush may be waiting too)

    def flush(self, timeout: float = 10.0) -> None:
        """Write every waiting success now and wait for it (or give up after timeout)."""
        if not self.running:
            return
        with self._cond:
            self._flushing = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: not (self._pending or self._inflight), timeout)
            self._flushing = False

    def _next(self) -> tuple[list[Item] | None, float | None]:
        self._idle = not self._pending
        if self._idle:
            return None, None
        wait = self._since + self.LINGER - time.monotonic()
        if wait > 0 and not self._flushing and len(self._pending) < self.MAX_PER_WRITE:
            return None, wait
        taken, self._pending = self._pending[: self.MAX_PER_WRITE], self._pending[self.MAX_PER_WRITE :]
        self._since = time.monotonic()
        self._inflight += len(taken)
        return taken, None

    def _drain(self, taken: list[Item]) -> None:
        try:
            self._record(taken)
        except Exception:
            log.exception("celery-lease: cannot record %d successes; the reaper will requeue them", len(taken))
        finally:
            self._written(taken)

    def _written(self, taken: list[Item]) -> None:
        try:
            for attempt, _, _ in taken:
                attempt.pending_write = False
        finally:
            with self._cond:
                self._inflight -= len(taken)
                self._cond.notify_all()

    def _record(self, taken: list[Item]) -> None:
        write_successes(self._pipeline, taken, self._complete_many)

    def _complete_many(self, live: list[Item]) -> set[str]:
        """END for these successes, in one statement, through the pipeline (its Landing
        settles a lost reply); tried again while the database is unreachable, also for
        the attempts whose leases lapsed by their own clocks meanwhile: their bodies
        finished, and the statement is fenced (a job the reaper took is not written).
        Dropped, the success was lost while its row stayed running under this process
        (issue #27, item 4); only a lease known lost is."""
        try:
            rows = self._pipeline.execute(tr.END, tr.ending_params(successes(live)), attempts=[item[0] for item in live])
        except LeaseLost:  # every one known lost
            return set()
        return {str(r["id"]) for r in rows}
