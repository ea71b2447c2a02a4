"""Reaper, sweeper, pruner and restart recovery.

Each works in bounded chunks (``batch_size`` rows per statement, a bounded number of
statements per call) and returns counts. Beat tasks only call them (see
:mod:`celery_lease.beat.entries`); several beats may run them at once, since every
chunk is selected with SKIP LOCKED on PostgreSQL (SQLite serializes writers).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from celery_lease.db.landing import LANDING_RETENTION
from celery_lease.lifecycle import transition as tr
from celery_lease.lifecycle.owner import BOOT_ID
from celery_lease.status import Status

if TYPE_CHECKING:
    from celery_lease.db.store import Store
    from celery_lease.flow.control import FlowControl
    from celery_lease.lifecycle.pipeline import Pipeline
    from celery_lease.settings import Settings

log = logging.getLogger("celery_lease.maintenance")

#: Upper bound on statements one call issues; what is left waits for the next tick.
MAX_CHUNKS = 20
#: Seconds an outbox row is left to the worker that wrote it (which sends it right after
#: the commit it heard) before the sweeper sends it.
OUTBOX_AGE = 5.0


def _chunks(step: Callable[[], tuple[list, bool]]) -> list:
    out = []
    for _ in range(MAX_CHUNKS):
        rows, full = step()
        out.extend(rows)
        if not full:
            break
    return out


class Maintenance:
    def __init__(
        self,
        store: Store,
        lifecycle: Pipeline,
        publish_sweep: Callable[[Sequence[dict]], int],
        settings: Settings,
        flow: FlowControl | None = None,
    ) -> None:
        self._store = store
        #: Reap and restart recovery are transitions (celery_lease/lifecycle): requeued
        #: jobs get their wakeups, ended ones their errbacks, limited ones free their
        #: slots, once each.
        self._lifecycle = lifecycle
        #: Flow control: the sweep also recovers held jobs whose wakeup was missed.
        self._flow = flow
        #: The sweep's wakeups, its re-sends gated (Producer.publish_sweep).
        self._publish = publish_sweep
        self._settings = settings

    @staticmethod
    def _requeue_counts(rows: list[dict], final: Status) -> dict[str, int]:
        requeued = sum(1 for r in rows if r["status"] == Status.PENDING.value)
        return {"requeued": requeued, final.value: len(rows) - requeued}

    def reap(self) -> dict[str, int]:
        """Running jobs whose lease elapsed: back to pending with a wakeup while
        attempts remain, else expired with error "lease expired"."""
        if not self._store.any_lease_elapsed():
            # The common tick: one read, no transaction (the reap transition's would
            # take a transaction id and commit durably even when it finds nothing).
            return {"requeued": 0, Status.EXPIRED.value: 0}
        limit = self._settings.batch_size

        def step():
            rows = self._lifecycle.execute(tr.REAP, {"limit": limit})
            return rows, len(rows) == limit

        counts = self._requeue_counts(_chunks(step), Status.EXPIRED)
        if any(counts.values()):
            log.warning("celery-lease: reaped expired leases: %s", counts)
        return counts

    def recover(self, node: str) -> dict[str, int]:
        """Jobs left running by an earlier boot of worker ``node``: requeued, or failed
        with "interrupted by restart" when no attempts remain."""
        rows = self._lifecycle.execute(tr.RECOVER, build={"owner_prefix": f"{node}/", "owner_boot": f"/{BOOT_ID}"})
        return self._requeue_counts(rows, Status.FAILED)

    def sweep(self) -> int:
        """Publish wakeups for due pending jobs whose last wakeup is stale or missing."""
        limit = self._settings.batch_size
        stale = self._settings.sweep_stale_seconds

        def step():
            rows = self._store.claim_due_wakeups(stale, limit)
            return rows, len(rows) == limit

        rows = _chunks(step)
        sent = self._publish(rows)
        if self._flow is not None:
            sent += self._flow.sweep()
        if rows:
            log.debug("celery-lease: swept %d wakeup(s), %d published", len(rows), sent)
        return sent + self.drain_outbox()

    def drain_outbox(self) -> int:
        """Apply the follow-ups left in the outbox for OUTBOX_AGE seconds: their
        transition committed, and its writer did not hear it or died before sending."""
        limit = self._settings.batch_size

        def step():
            rows = self._store.take_outbox(OUTBOX_AGE, limit)
            return rows, len(rows) == limit

        rows = _chunks(step)
        if not rows:
            return 0
        sent = self._lifecycle.send_outbox(rows)
        log.warning("celery-lease: sent %d of %d follow-up(s) whose transition's writer did not", sent, len(rows))
        return sent

    def archive(self) -> int:
        """Move finished jobs that finished ``archive_after`` seconds ago, and their
        events, into the day-partitioned history (PostgreSQL). Returns how many moved."""
        limit, after = self._settings.batch_size, self._settings.archive_after
        if not self._store.prepare_archive(after):
            return 0

        def step():
            n = self._store.archive(after, limit)
            return [None] * n, n == limit

        moved = len(_chunks(step))
        if moved:
            log.debug("celery-lease: archived %d finished job(s)", moved)
        return moved

    def prune(self, older_than: float | None = None) -> int:
        """Delete terminal jobs (and their events) finished more than ``older_than``
        seconds ago (default: ``retention_seconds``), and chord counters as old whose
        header has no pending or running job left (their body can never be created).
        Returns the number of jobs deleted from the hot table; the history's days that
        ended more than ``older_than`` ago are dropped whole (PostgreSQL)."""
        age = self._settings.retention_seconds if older_than is None else float(older_than)
        limit = self._settings.batch_size

        def step():
            n = self._store.prune(age, limit)
            return [None] * n, n == limit

        def chord_step():
            n = self._store.prune_chords(age, limit)
            return [None] * n, n == limit

        def landing_step():
            n = self._store.prune_landings(LANDING_RETENTION, limit)
            return [None] * n, n == limit

        pruned = len(_chunks(step))
        days = self._store.drop_history(age)
        if days:
            log.info("celery-lease: dropped %d day(s) of finished jobs from the history", days)
        chords = len(_chunks(chord_step))
        _chunks(landing_step)
        if chords:
            log.info("celery-lease: pruned %d chord counter(s) whose header can no longer complete", chords)
        return pruned
