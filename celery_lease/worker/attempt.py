"""One claimed attempt of a job: its fencing token and the lease's local state.

The rule: every write an attempt makes goes through :meth:`Attempt.write` (progress,
checkpoints) or a fenced transition (its outcome: celery_lease/lifecycle), a guarded
statement matching the job's id, ``running`` and this attempt's ``lease_generation``. Zero
rows means the lease is lost; :meth:`mark_lost` records that once, and the handler sees
``ctx.cancelled``. The attempt also judges its lease by its own monotonic clock: once
``LAPSE_SHARE`` of ``lease_seconds`` has passed since the last confirmed renewal (counted
from when it was *sent*), the lease is lost whatever the heartbeat is doing, so a
heartbeat stuck on a dead connection cannot keep a handler running after the reaper has
handed its job to another worker.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from celery_lease.db.outage import retry_within_lease
from celery_lease.errors import LeaseLost

if TYPE_CHECKING:
    from celery_lease.db.store import Store

log = logging.getLogger("celery_lease.worker")

T = TypeVar("T")

#: Share of its lease after which an attempt with no confirmed renewal counts as lost:
#: the margin covers a process paused by the scheduler and the clocks' drift.
LAPSE_SHARE = 0.8
#: Share of its lease after which a claim's reply comes too late for its body to start
#: (a long wait for its kind's lock, a reply delayed in flight): the lease, counted from
#: before the claim was sent, is nearly lapsed and the job may soon be another
#: worker's. The rest of the lease leaves time to hand the job back.
START_SHARE = 0.5


class HeldMark(NamedTuple):
    """A many-job delivery's hold on its wakeup's mark (broker/waking.py, worker/many_claim.py)."""

    owner: str  # the owner its claims are for
    key: str  # the mark
    seen: str  # the count it knew before its last claim (read, or waking.PUSHED) ...
    at: float  # ... when (monotonic)


@dataclass(eq=False)
class Attempt:
    job_id: str
    generation: int
    attempt: int
    max_attempts: int
    lease_seconds: int
    run_id: str | None
    parent_id: str | None
    tenant: str | None
    payload: Any
    checkpoint: Any
    #: What Celery's canvas asked of this job (chain, link, chord...), or None.
    canvas: Any = None
    #: The outcome this attempt recorded (an executor.Outcome), None while running or when
    #: nothing was recorded (lease lost).
    outcome: Any = None
    #: Set once the lease counts as lost: known lost, or lapsed by this process's clock
    #: (is_lost).
    lost: threading.Event = field(default_factory=threading.Event)
    #: The lease is known lost (mark_lost: a fenced write or a renewal matched no row,
    #: or the attempt was stopped), not merely lapsed by this process's clock. A body that
    #: finished before its clock lapsed still has its success written (fenced: it lands
    #: only while no one took the job), never dropped while its row runs under this owner.
    known_lost: bool = False
    #: monotonic time at which the last claim or renewal that the database confirmed
    #: was sent.
    renewed_at: float = field(default_factory=time.monotonic)
    #: Its success is queued in the Completer, not written yet.
    pending_write: bool = False
    #: Monotonic time after which the attempt is stopped and retried (kind's timeout).
    deadline: float | None = None
    kind: str = ""
    #: What a concurrency limit counts this job under (its kind's key function, at submit).
    concurrency_key: str | None = None
    queue: str | None = None
    #: The submit's trace context stored with the job, and this attempt's span
    #: (celery_lease.tracing); the span is None while tracing is off.
    trace_context: str | None = None
    span: Any = None
    #: A many-job claim's delivery (worker/many_claim.py): every attempt its claim took,
    #: this one (the delivery's own) first; None for a claim of one job.
    claimed_together: list[Attempt] | None = None
    #: Such a delivery whose last claim came back full (more was due): the owner it
    #: claims for, to claim again once what it took has run; else None.
    claims_again_for: str | None = None
    #: Such a delivery that holds its wakeup's mark (broker/waking.py); else None.
    holds_mark: HeldMark | None = None

    @classmethod
    def from_claim(cls, job_id: str, row: dict[str, Any], *, sent_at: float | None = None) -> Attempt:
        """``sent_at``: monotonic time at which the claim was sent."""
        return cls(
            renewed_at=time.monotonic() if sent_at is None else sent_at,
            job_id=job_id,
            generation=row["lease_generation"],
            attempt=row["attempt"],
            max_attempts=row["max_attempts"],
            lease_seconds=row["lease_seconds"],
            run_id=row["run_id"] and str(row["run_id"]),
            parent_id=row["parent_id"] and str(row["parent_id"]),
            tenant=row["tenant"],
            payload=row["payload"],
            checkpoint=row["checkpoint"],
            canvas=row.get("canvas"),
            kind=row.get("kind", ""),
            concurrency_key=row.get("concurrency_key"),
            queue=row.get("queue"),
            trace_context=row.get("trace_context"),
        )

    @property
    def key(self) -> tuple[str, int]:
        """(job, generation): two attempts of one job never share it."""
        return self.job_id, self.generation

    @property
    def fence(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "generation": self.generation}

    @property
    def lapses_at(self) -> float:
        """Monotonic time at which the lease counts as lost without a renewal."""
        return self.renewed_at + self.lease_seconds * LAPSE_SHARE

    @property
    def is_lost(self) -> bool:
        if self.lost.is_set():
            return True
        if time.monotonic() >= self.lapses_at:
            log.warning("celery-lease: job %s: no lease renewal confirmed in time; lease lost", self.job_id)
            self.lost.set()
            return True
        return False

    @property
    def late_to_start(self) -> bool:
        """Its body must not start: less than START_SHARE of the lease is left, counted
        from the claim's send or the last renewal confirmed since (the claim's follow-ups
        run with the attempt in the heartbeat). The reaper and another worker may take
        the job any moment: it is handed off."""
        return time.monotonic() - self.renewed_at > self.lease_seconds * START_SHARE

    def mark_lost(self) -> None:
        self.known_lost = True
        self.lost.set()

    def retry_within_lease(self, write: Callable[[], T], on_retry: Callable[[], None] | None = None) -> T:
        """Run ``write`` (one of this attempt's writes), tried again while the database
        is unreachable until the lease lapses by this attempt's own clock, then LeaseLost
        (db.outage.retry_within_lease): the handler's checkpoint or outcome lands once the
        database is back."""
        return retry_within_lease(
            write, lambda: self.is_lost, lapses_at=lambda: self.lapses_at, on_retry=on_retry, what=f"job {self.job_id}"
        )

    def write(self, store: Store, stmt, **params: Any) -> bool:
        """One fenced statement committed alone; False (writing nothing) when the lease
        is lost, now or before, or lapses while the database is unreachable."""
        try:
            if self.retry_within_lease(lambda: store.guarded(stmt, {**self.fence, **params})):
                return True
        except LeaseLost:
            return False
        self.mark_lost()
        return False
