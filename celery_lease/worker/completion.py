"""Where every attempt's ending is written: the process's one :class:`Completer`, for
single jobs and many-job claims alike (a success with effects or children keeps its
own transaction: worker/record.py).

:class:`BackgroundCompleter` (PostgreSQL): a plain success waits at most a few
milliseconds for this thread's one END of every ending gathered (one durable commit for
all: the pipeline's, whose Landing settles a lost reply); any other ending (fail, retry,
snooze, hand off) is written at once with what waits, its caller waiting for it. Each row
is fenced by its generation; one missing from the result is re-checked alone
(:func:`confirm`); a success whose lease lapsed only by its own clock (the database
away) is still written. A process that dies first leaves the job running under its
lease, for the reaper. :class:`InlineCompleter` (SQLite) writes each at once. Warm exits
flush.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from celery_lease.db.refused import refused_value
from celery_lease.errors import LeaseLost
from celery_lease.lifecycle import transition as tr
from celery_lease.status import AttemptOutcome
from celery_lease.worker.runtime import Drainer

if TYPE_CHECKING:
    from celery_lease.db.store import Store
    from celery_lease.lifecycle.pipeline import Pipeline
    from celery_lease.worker.attempt import Attempt

log = logging.getLogger("celery_lease.worker")

#: The stored error of a success whose values the database refused.
UNSTORABLE_RESULT = "result could not be stored"


@dataclass
class Item:
    """One attempt's ending, waiting to be written; ``waited`` (an ending other than a
    plain success) is set once written or given up, ``error`` then says why not."""

    attempt: Attempt
    ending: tr.Ending
    waited: threading.Event | None = None
    error: BaseException | None = field(default=None, repr=False)

    @property
    def success(self) -> bool:
        return self.ending.outcome is AttemptOutcome.SUCCEEDED


def write_endings(pipeline: Pipeline, items: list[Item]) -> None:
    """Write many endings with one END: the one algorithm of the completer. An ending
    whose lease is known lost is not written; one missing from the result is re-checked
    alone (confirm); a group with a value the database refused is written one by one,
    and a refused success ends its job failed (refuse). What cannot be written is
    told to its waiter (``Item.error``) or, for a plain success, logged."""
    for item in items:
        if item.attempt.known_lost:
            item.error = LeaseLost()
    live = [item for item in items if item.error is None]
    if not live:
        return
    try:
        rows = pipeline.execute(tr.END, tr.ending_params([i.ending for i in live]), attempts=[i.attempt for i in live])
    except LeaseLost:  # every one known lost
        rows = []
    except Exception as exc:
        if not refused_value(exc):
            for item in live:
                item.error = exc
            raise
        # Values are checked before they are queued, so this is a last line of
        # defence: one row must not cost the others.
        if len(live) == 1:
            refuse(pipeline, live[0], exc)
            return
        log.exception("celery-lease: %d endings were refused together; writing them one by one", len(live))
        for item in live:
            write_endings(pipeline, [item])
        return
    confirm(pipeline, live, {str(r["id"]) for r in rows})


def confirm(pipeline: Pipeline, items: list[Item], done: set[str]) -> None:
    """Re-check alone each ending missing from ``done``: lost, or a row the many-row
    statement did not re-qualify after a concurrent update (a renewal) changed it. The
    single fenced END decides which, so no ending is discarded by a race."""
    for item in items:
        if item.attempt.job_id in done:
            continue
        try:
            if item.attempt.known_lost:
                raise LeaseLost()
            pipeline.execute(tr.END, tr.ending_params([item.ending]), attempt=item.attempt, error=item.ending.error)
        except LeaseLost as exc:
            item.error = exc
            if item.success:
                log.warning("celery-lease: job %s: lease lost; success discarded", item.attempt.job_id)
        except Exception as exc:
            item.error = exc
            if item.success:
                log.exception("celery-lease: job %s: cannot record its success; the reaper will requeue it", item.attempt.job_id)


def refuse(pipeline: Pipeline, item: Item, exc: Exception) -> None:
    """The database refused this success's values: the job ends failed (fenced), never
    stuck running nor silently dropped. (Only a success carries values of the body's.)"""
    attempt = item.attempt
    item.error = exc
    if not item.success:
        return
    try:
        ending = tr.Ending.failed(attempt, UNSTORABLE_RESULT)
        pipeline.execute(tr.END, tr.ending_params([ending]), attempt=attempt, error=UNSTORABLE_RESULT)
        log.error("celery-lease: job %s: %s", attempt.job_id, UNSTORABLE_RESULT)
    except LeaseLost:
        log.warning("celery-lease: job %s: lease lost; refused success discarded", attempt.job_id)
    except Exception:
        log.exception("celery-lease: job %s: cannot record its refused success; the reaper will requeue it", attempt.job_id)


class Completer(Protocol):
    """Writes endings; ``attempt.pending_write`` is cleared once a plain success is
    written or given up on."""

    def add(self, attempt: Attempt, ending: tr.Ending) -> None:
        """Hand over a plain success; the inline completer writes it before returning
        (and raises LeaseLost or DatabaseUnavailable as the write did)."""

    def end(self, attempt: Attempt, ending: tr.Ending) -> None:
        """Write any other ending now and return once it is written; raises LeaseLost
        (nothing written) or DatabaseUnavailable."""

    def flush(self, timeout: float = 10.0) -> None:
        """Write every waiting ending now (warm exit)."""


def completer_for(store: Store, pipeline: Pipeline) -> Completer:
    return BackgroundCompleter(pipeline) if store.capabilities.background_completions else InlineCompleter(pipeline)


class InlineCompleter:
    """Each ending written at once, in its own durable transaction."""

    def __init__(self, pipeline: Pipeline) -> None:
        self._pipeline = pipeline

    def add(self, attempt: Attempt, ending: tr.Ending) -> None:
        try:
            self.end(attempt, ending)
        finally:
            attempt.pending_write = False

    def end(self, attempt: Attempt, ending: tr.Ending) -> None:
        self._pipeline.execute(tr.END, tr.ending_params([ending]), attempt=attempt, error=ending.error)

    def flush(self, timeout: float = 10.0) -> None:
        pass


class BackgroundCompleter(Drainer):
    #: Seconds the oldest waiting success waits for others to share its statement.
    LINGER = 0.002
    MAX_PER_WRITE = 64
    #: Seconds between a waiting caller's looks at its own lease.
    WAIT_STEP = 0.1

    def __init__(self, pipeline: Pipeline) -> None:
        super().__init__("celery-lease-completer")
        self._pipeline = pipeline
        #: Endings waiting, oldest first; the oldest arrived at _since.
        self._pending: list[Item] = []
        self._since = 0.0
        #: Endings taken by this thread and not yet written.
        self._inflight = 0
        self._flushing = False
        #: A caller waits for an ending among the pending: write now, no linger.
        self._urgent = False
        #: The thread waits with no timeout (nothing pending): an arrival must wake it.
        self._idle = False

    def add(self, attempt: Attempt, ending: tr.Ending) -> None:
        self._queue(Item(attempt, ending))

    def end(self, attempt: Attempt, ending: tr.Ending) -> None:
        """Queued with what waits, written at once; the caller waits for it while its
        lease lives by its own clock (after that, as for its body, the outcome is no
        longer its to report: LeaseLost, though the fenced write may still land)."""
        item = Item(attempt, ending, waited=threading.Event())
        self._queue(item, urgent=True)
        assert item.waited is not None
        while not item.waited.wait(self.WAIT_STEP):
            if attempt.is_lost:
                raise LeaseLost()
        if item.error is not None:
            raise item.error

    def _queue(self, item: Item, urgent: bool = False) -> None:
        with self._cond:
            self._start()
            if not self._pending:
                self._since = time.monotonic()
            self._pending.append(item)
            self._urgent |= urgent
            # A thread already timing a write finds this one when it wakes: no wake-up
            # per job.
            if self._idle or urgent or len(self._pending) >= self.MAX_PER_WRITE:
                self._cond.notify_all()  # the thread (a flush may be waiting too)

    def flush(self, timeout: float = 10.0) -> None:
        """Write every waiting ending now and wait for it (or give up after timeout)."""
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
        if wait > 0 and not (self._flushing or self._urgent) and len(self._pending) < self.MAX_PER_WRITE:
            return None, wait
        taken, self._pending = self._pending[: self.MAX_PER_WRITE], self._pending[self.MAX_PER_WRITE :]
        self._urgent = any(i.waited is not None for i in self._pending)
        self._since = time.monotonic()
        self._inflight += len(taken)
        return taken, None

    def _drain(self, taken: list[Item]) -> None:
        try:
            self._write_many(taken)
        except Exception:
            log.exception("celery-lease: cannot record %d endings; the reaper will requeue them", len(taken))
        finally:
            self._written(taken)

    def _written(self, taken: list[Item]) -> None:
        try:
            for item in taken:
                if item.waited is not None:
                    item.waited.set()
                else:
                    item.attempt.pending_write = False
        finally:
            with self._cond:
                self._inflight -= len(taken)
                self._cond.notify_all()

    def _write_many(self, taken: list[Item]) -> None:
        """END for these endings, in one statement, through the pipeline (its Landing
        settles a lost reply); tried again while the database is unreachable, also for
        the attempts whose leases lapsed by their own clocks meanwhile: their bodies
        finished, and the statement is fenced (a job the reaper took is not written).
        Dropped, a success was lost while its row stayed running under this process
        (issue #27, item 4); only a lease known lost is."""
        write_endings(self._pipeline, taken)
