"""The flow-control transactions: one method each, over the named statements of
:mod:`celery_lease.db.queries` ("flow control" section). The decisions around them
(which path a claim takes, what to publish) are :mod:`celery_lease.flow`.

Lock order, everywhere: a kind's limits row (``lock_limits`` / ``lock_limits_row``),
then its pause row (FOR SHARE, inside ``hold_job``), then job rows. Resume takes the
pause row, then job rows. Nothing takes a limits row while holding a job row, so these
transactions cannot deadlock with each other or with cancel and reap (job rows only).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from celery_lease.db import queries as q
from celery_lease.status import Event, Status

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

    from celery_lease.db.store import Store
    from celery_lease.limits import Limits

#: The reasons a pending job is held (the jobs.held column).
PAUSE, RATE, LIMIT = "pause", "rate", "limit"


@dataclasses.dataclass
class ClaimResult:
    #: The claimed row (the job claimed may be another than the one delivered).
    row: dict[str, Any] | None = None
    #: Why the delivered job is held, when it is.
    held: str | None = None
    #: The delivered job is pending, due and held by nothing: claim it again.
    retry: bool = False
    #: Wakeups to publish now (jobs woken because a new rate window opened).
    wake: list[dict] = dataclasses.field(default_factory=list)
    #: (seconds, wakeup): the wakeup to publish at the start of the next rate window.
    later: tuple[float, dict] | None = None


def _window(state: Any, per_seconds: int) -> tuple[int, int]:
    """(the current rate window, claims already counted in it) from a limits row.

    A claim whose transaction began in an older window than the one stored (it waited
    for the lock across the boundary) counts as a full window: it waits for the next
    one, so no window ever holds more claims than the rate, whichever way they are
    grouped (by window or by the claims' started_at)."""
    window = int(math.floor(float(state["now_epoch"]) / per_seconds))
    if window > state["rate_window"]:
        return window, 0
    if window == state["rate_window"]:
        return window, state["rate_claims"]
    return state["rate_window"], 2**31


class FlowStore:
    def __init__(self, store: Store) -> None:
        self._store = store

    def _tx(self, fn):
        # Fast commits: like the claim itself, what these write is protected by the
        # lease (a lost commit leaves a job pending, which the sweeper recovers).
        return self._store.transaction(self._store.fast, fn)

    # --- claims ----------------------------------------------------------------------

    def claim_limited(self, job_id: str, owner: str, kind: str, limits: Limits) -> ClaimResult:
        """The claim of a limited kind, in one transaction under its limits row lock:
        the rate window, then claim_job_limited, else hold_job."""
        rate = limits.rate

        def work(conn: Connection) -> ClaimResult:
            state = (
                conn.execute(
                    q.lock_limits(self._store.dialect),
                    {
                        "of_kind": kind,
                        "new_concurrency": limits.concurrency,
                        "new_rate": rate and rate.count,
                        "new_per_seconds": rate and rate.per_seconds,
                    },
                )
                .mappings()
                .one()
            )
            window, used = _window(state, rate.per_seconds) if rate else (0, 0)
            rate_spent = rate is not None and used >= rate.count
            if not rate_spent:
                params = {"job_id": job_id, "owner": owner, "concurrency": limits.concurrency}
                row = conn.execute(q.claim_job_limited(limits.concurrency is not None), params).mappings().first()
                if row is not None:
                    self._store.log_events(conn, [(row, Event.CLAIMED, owner)])
                    result = ClaimResult(row=dict(row))
                    if rate is not None:
                        conn.execute(q.count_rate_claim(), {"of_kind": kind, "new_window": window, "new_claims": used + 1})
                        if used == 0 and rate.count > 1:
                            # The first claim of a window wakes the jobs held for it.
                            result.wake = self._wake(conn, RATE, kind, None, rate.count - 1)
                    return result
            held = conn.execute(
                q.hold_job(), {"job_id": job_id, "rate_spent": rate_spent, "concurrency": limits.concurrency}
            ).first()
            if held is None:
                return ClaimResult()  # not pending or not due: a duplicate delivery
            if held.held is None:
                return ClaimResult(retry=True)
            result = ClaimResult(held=held.held)
            if held.held == RATE and rate is not None:
                # One wakeup per kind for the next window's start (the first claim there
                # wakes the rest); the sweeper recovers it if it is lost.
                if conn.execute(q.schedule_window_wakeup(), {"of_kind": kind, "new_window": window + 1}).rowcount:
                    seconds = (window + 1) * rate.per_seconds - float(state["now_epoch"])
                    result.later = (max(0.0, seconds), {"id": job_id})
            return result

        return self._tx(work)

    def hold(self, job_id: str) -> ClaimResult:
        """After a refused claim of an unlimited kind: held for a pause, or (retry) not
        held by anything, or neither (a duplicate delivery)."""

        def work(conn: Connection) -> ClaimResult:
            held = conn.execute(q.hold_job(), {"job_id": job_id, "rate_spent": False, "concurrency": None}).first()
            if held is None:
                return ClaimResult()
            return ClaimResult(held=held.held, retry=held.held is None)

        return self._tx(work)

    def claim_target(self, job_id: str) -> tuple[str, str | None] | None:
        """(kind, concurrency key) of a job, if it exists."""
        row = self._store.transaction(self._store.durable, lambda c: c.execute(q.get_claim_target(), {"job_id": job_id}).first())
        return None if row is None else (row.kind, row.concurrency_key)

    # --- waking held jobs --------------------------------------------------------------

    def _wake(self, conn: Connection, reason: str, kind: str, key: Any, limit: float, by_key: bool = False) -> list[dict]:
        if limit <= 0:
            return []
        params = {"reason": reason, "of_kind": kind, "key": key, "limit": int(min(limit, 2**31 - 1))}
        return [dict(r) for r in conn.execute(q.wake_held(by_key), params).mappings()]

    def top_up(self, kind: str, key: str | None) -> list[dict]:
        """Under the kind's limits row lock: wake as many jobs held for its limit (of
        ``key``) and for its rate as there is capacity now. Called when a slot frees,
        and by the sweeper's recovery. Returns the wakeups to publish."""

        def work(conn: Connection) -> list[dict]:
            state = conn.execute(q.lock_limits_row(), {"of_kind": kind}).mappings().first()
            if state is None:
                return []
            budget: float = math.inf
            if state["rate"]:
                _, used = _window(state, state["per_seconds"])
                budget = max(0, state["rate"] - used)
            woken: list[dict] = []
            if state["concurrency"]:
                running = conn.execute(q.running_count(), {"of_kind": kind, "key": key}).scalar_one()
                woken += self._wake(conn, LIMIT, kind, key, min(state["concurrency"] - running, budget), by_key=True)
            if state["rate"]:
                woken += self._wake(conn, RATE, kind, None, budget - len(woken))
            return woken

        return self._tx(work)

    def wake_all(self, reason: str, kind: str, batch: int) -> list[dict]:
        """Wake every job of ``kind`` held for ``reason`` (a resume), in batches."""
        out: list[dict] = []
        while True:
            rows = self._store.transaction(self._store.durable, lambda c: self._wake(c, reason, kind, None, batch))
            out += rows
            if len(rows) < batch:
                return out

    def limited_groups(self, ids: Sequence[str]) -> list[tuple[str, str | None]]:
        if not ids:
            return []
        rows = self._store.transaction(self._store.durable, lambda c: c.execute(q.limited_groups(ids)).all())
        return [(r.kind, r.concurrency_key) for r in rows]

    def stale_held_groups(self, stale_seconds: float, limit: int) -> list[tuple[str, str | None, str]]:
        params = {"stale_seconds": stale_seconds, "limit": limit}
        rows = self._store.transaction(self._store.durable, lambda c: c.execute(q.stale_held_groups(), params).all())
        return [(r.kind, r.concurrency_key, r.held) for r in rows]

    # --- pause -----------------------------------------------------------------------

    def pause(self, kind: str) -> bool:
        """True when this call paused the kind (False: it already was)."""
        stmt = q.pause_kind(self._store.dialect)
        return self._store.transaction(self._store.durable, lambda c: c.execute(stmt, {"of_kind": kind}).rowcount == 1)

    def resume(self, kind: str) -> bool:
        return self._store.transaction(self._store.durable, lambda c: c.execute(q.resume_kind(), {"of_kind": kind}).rowcount == 1)

    def is_paused(self, kind: str) -> bool:
        row = self._store.transaction(self._store.durable, lambda c: c.execute(q.is_paused(), {"of_kind": kind}).first())
        return row is not None

    # --- what operators see --------------------------------------------------------

    def overview(self, tenant: str | None = None) -> dict[str, Any]:
        """Declared limits, pauses, and active jobs per (kind, key, status, held)."""

        def work(conn: Connection) -> dict[str, Any]:
            return {
                "limits": [dict(r) for r in conn.execute(q.list_limits()).mappings()],
                "pauses": [dict(r) for r in conn.execute(q.list_pauses()).mappings()],
                "counts": [tuple(r) for r in conn.execute(q.flow_counts(tenant))],
            }

        return self._store.transaction(self._store.durable, work)


#: The statuses a view of flow control counts.
ACTIVE = (Status.PENDING.value, Status.RUNNING.value)
