"""The flow-control transactions: one method each, over the named statements of
:mod:`celery_lease.db.statements.flow`; a limited kind's claim is the CLAIM_LIMITED
transition (:mod:`celery_lease.lifecycle.claim`). The decisions around them (which path a
claim takes, what to publish) are :mod:`celery_lease.flow.control`.

Lock order, everywhere: a kind's limits row (``lock_limits`` / ``lock_limits_row``),
then its pause row (FOR SHARE, inside ``hold_job``), then job rows. Resume takes the
pause row, then job rows. Nothing takes a limits row while holding a job row, so these
transactions cannot deadlock with each other or with cancel and reap (job rows only).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from celery_lease.db.statements import flow as fs
from celery_lease.lifecycle import claim as lifecycle_claim
from celery_lease.lifecycle.claim import CLAIM_LIMITED, ClaimFollowUps
from celery_lease.status import Held

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

    from celery_lease.db.store import Store
    from celery_lease.flow.limits import LimitChange, Limits


log = logging.getLogger("celery_lease.flow")


class _NoWakeup(Exception):
    """No wakeup for the next rate window: its transaction is rolled back."""


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
    #: With ``retry``: the delivered job's wakeup, to send again if it stays unclaimed.
    again: dict | None = None


def declared_limits(kind: str, declared: Limits | None) -> dict[str, Any]:
    """flow.lock_limits' parameters: the limits the code declares for ``kind``."""
    rate = None if declared is None else declared.rate
    return {
        "of_kind": kind,
        "new_concurrency": None if declared is None else declared.concurrency,
        "new_rate": rate and rate.count,
        "new_per_seconds": rate and rate.per_seconds,
    }


class FlowStore:
    """The statements of one step (lock, then claim; lock, then hold; lock, then wake)
    run alone in their transaction (Store.alone: prepared, one round trip)."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def _tx(self, fn):
        # Fast commits: like the claim itself, what these write is protected by the
        # lease (a lost commit leaves a job pending, which the sweeper recovers).
        return self._store.transaction(self._store.fast, fn)

    # --- claims ----------------------------------------------------------------------

    def claim_limited(
        self,
        job_id: str,
        owner: str,
        kind: str,
        task: str,
        declared: Limits | None,
        *,
        follow_ups: ClaimFollowUps | None = None,
    ) -> ClaimResult:
        """The claim of a limited kind: the CLAIM_LIMITED transition (lock_limits, which
        records the limits the code ``declared``, then the limited claim with its run
        event and the rate window's count, in one transaction; a lost reply settled by
        what landed, see LandedClaim); refused, hold_job under the lock
        again (the reason is decided on what a release would see). Both read the limits
        in force from the row, an operator's override included. A claim that opened a
        rate window wakes the jobs held for it, as its follow-up (with the caller's
        ``follow_ups``)."""
        params = {"job_id": job_id, "owner": owner, "wakeup_task": task, **declared_limits(kind, declared)}
        result = ClaimResult()

        def window_opened(row: dict[str, Any]) -> None:
            # This claim opened a rate window (of window_rate claims, the rate in force):
            # wake the jobs held for it, and if that may not be all, one of those left
            # carries the next window's wakeup. (If this fails, the held jobs wait for
            # the sweeper's recovery: stale_held_groups.)
            more = row["window_rate"] - 1
            result.wake = self._tx(lambda c: self._wake(c, Held.RATE, kind, more))
            if len(result.wake) == more:
                result.later = self._window_wakeup(kind, None)

        # Built with both guards whatever the code declares: an override may set either.
        build = {"concurrency": True, "rate": True}
        f = dataclasses.replace(follow_ups or ClaimFollowUps(), window_opened=window_opened)
        row = lifecycle_claim.execute(self._store, CLAIM_LIMITED, params, build=build, follow_ups=f)
        if row is not None:
            result.row = row
            return result
        result = self._hold(job_id, task, kind)
        if result.held == Held.RATE:
            result.later = self._window_wakeup(kind, job_id)
        return result

    def _window_wakeup(self, kind: str, job_id: str | None) -> tuple[float, dict] | None:
        """(seconds, wakeup): the one wakeup of the kind's next rate window (the first
        claim there wakes the rest), carried by ``job_id`` (None: a job still held for
        the rate), due at the window's start by the database clock (await_window). None
        when that window's wakeup is sent already, or no job is held to carry it: the
        window is then left unscheduled, for the next refused claim. The sweeper
        recovers a lost one."""

        def work(conn: Connection) -> tuple[float, dict]:
            seconds = conn.execute(fs.schedule_window_wakeup(), {"of_kind": kind}).scalar()
            if seconds is None:
                raise _NoWakeup()
            seconds = max(0.0, float(seconds))
            params = {"job_id": job_id, "of_kind": kind, "seconds": seconds}
            carrier = conn.execute(fs.await_window(), params).mappings().first()
            if carrier is None:
                raise _NoWakeup()  # rolls the schedule back
            return seconds, dict(carrier)

        try:
            return self._tx(work)
        except _NoWakeup:
            return None

    def many_claim_follow_ups(self, kind: str, first: dict[str, Any]) -> tuple[list[dict], tuple[float, dict] | None]:
        """After a limited kind's many-job claim (``first``: its first row): the jobs held
        for the rate that a window it opened still takes, woken (as a single claim's
        window_opened wakes them); and, when jobs are left held for the rate, the next
        window's wakeup (see _window_wakeup)."""
        woken: list[dict] = []
        more = 0
        claims, rate = first["window_claims"], first["window_rate"]
        if first["opened"] and claims is not None:
            more = rate - claims
            woken = self._tx(lambda c: self._wake(c, Held.RATE, kind, more))
        # A claim that spent its window schedules the next one too: jobs an earlier claim
        # held are not picked again, so a claim may take the window's last places while
        # others wait held, with no other wakeup left for them (the sweeper's until then).
        spent = claims is not None and rate is not None and claims >= rate
        left = bool(first["held_rate"]) or (more > 0 and len(woken) == more) or spent
        return woken, self._window_wakeup(kind, None) if left else None

    def hold(self, job_id: str, task: str) -> ClaimResult:
        """After a refused claim of an unlimited kind: held for a pause, or (retry) not
        held by anything, or neither (a duplicate delivery, or one for another task)."""
        return self._hold(job_id, task, None)

    def hold_paused(self, job_id: str, task: str) -> int:
        """The rest of a paused kind's due jobs, beside the delivered one (hold_paused)."""
        return len(self._store.alone(fs.hold_paused(), {"job_id": job_id, "wakeup_task": task}, fast=True))

    def _hold(self, job_id: str, task: str, kind: str | None) -> ClaimResult:
        params = {"job_id": job_id, "wakeup_task": task, "of_kind": kind, "limited": kind is not None}
        lock = fs.lock_limits_row() if kind is not None else None
        rows = self._store.alone(fs.hold_job(), params, lock=lock, fast=True)
        if not rows:
            return ClaimResult()  # not pending or not due: a duplicate delivery
        row = rows[0]
        held = row.pop("held")
        # Held by nothing: a slot or window freed since the claim was refused.
        return ClaimResult(held=held, retry=held is None, again=row if held is None else None)

    def claim_target(self, job_id: str) -> dict[str, Any] | None:
        """What get_claim_target reads of a job, if it exists."""
        stmt = fs.get_claim_target()
        row = self._store.transaction(self._store.durable, lambda c: c.execute(stmt, {"job_id": job_id}).mappings().first())
        return None if row is None else dict(row)

    # --- waking held jobs --------------------------------------------------------------

    def _wake(self, conn: Connection, reason: str, kind: str, limit: float) -> list[dict]:
        if limit <= 0:
            return []
        params = {"of_kind": kind, "limit": int(min(limit, 2**31 - 1))}
        return [dict(r) for r in conn.execute(fs.wake_held(Held(reason), self._store.dialect), params).mappings()]

    def wake_for_slot(self, kind: str, key: str | None) -> list[dict]:
        """A limited job of (kind, key) left running: under the kind's lock, wake the
        jobs held by its limit into the free slots (wake_for_slot). Returns wakeufs."""
        params = {"of_kind": kind, "key": key}
        return self._store.alone(fs.wake_for_slot(self._store.dialect), params, lock=fs.lock_limits_row(), fast=True)

    def top_up(self, kind: str, key: str | None) -> list[dict]:
        """Under the kind's limits row lock: wake as many jobs held for its limit (of
        ``key``) and for its rate as there is capacity now (the sweeper's recovery, and
        a spent delivery of a limited kind), in one statement after the lock (one
        round trip with the lock, prepared). Returns the wakeups to publish."""
        params = {"of_kind": kind, "key": key}
        return self._store.alone(fs.top_up(self._store.dialect), params, lock=fs.lock_limits_row(), fast=True)

    def wake_all(self, reason: str, kind: str, chunk: int) -> list[dict]:
        """Wake every job of ``kind`` held for ``reason`` (a resume), in chunks of ``chunk``."""
        out: list[dict] = []
        while True:
            rows = self._store.transaction(self._store.durable, lambda c: self._wake(c, reason, kind, chunk))
            out += rows
            if len(rows) < chunk:
                return out

    def limited_kinds(self, kinds: Sequence[str]) -> list[str]:
        """Which of these kinds have a limits row."""
        rows = self._store.transaction(self._store.durable, lambda c: c.execute(fs.limited_kinds(kinds)).all())
        return [r.kind for r in rows]

    def stale_held_groups(self, stale_seconds: float, limit: int) -> list[tuple[str, str | None, str]]:
        params = {"stale_seconds": stale_seconds, "limit": limit}
        rows = self._store.transaction(self._store.durable, lambda c: c.execute(fs.stale_held_groups(), params).all())
        return [(r.kind, r.concurrency_key, r.held) for r in rows]

    # --- pause -----------------------------------------------------------------------

    def pause(self, kind: str) -> bool:
        """True when this call paused the kind (False: it already was)."""
        stmt = fs.pause_kind(self._store.dialect)
        return self._store.transaction(self._store.durable, lambda c: c.execute(stmt, {"of_kind": kind}).rowcount == 1)

    def resume(self, kind: str) -> bool:
        stmt = fs.resume_kind()
        return self._store.transaction(self._store.durable, lambda c: c.execute(stmt, {"of_kind": kind}).rowcount == 1)

    def is_paused(self, kind: str) -> bool:
        row = self._store.transaction(self._store.durable, lambda c: c.execute(fs.is_paused(), {"of_kind": kind}).first())
        return row is not None

    # --- an operator's override ------------------------------------------------------

    def override(self, kind: str, change: LimitChange) -> None:
        """Store ``change`` to the kind's limits (override_limits). It binds every
        worker's next claim of a limited kind: their statements read it."""
        stmt = fs.override_limits(self._store.dialect)
        params = {"of_kind": kind, **change.params()}
        self._store.transaction(self._store.durable, lambda c: c.execute(stmt, params))

    def limits_rows(self) -> list[dict[str, Any]]:
        """Every limits row: what the workers declare and the operator's overrides."""
        return self._store.transaction(self._store.durable, lambda c: [dict(r) for r in c.execute(fs.list_limits()).mappings()])

    def overridden_kinds(self) -> frozenset[str]:
        rows = self._store.transaction(self._store.durable, lambda c: c.execute(fs.overridden_kinds()).all())
        return frozenset(r.kind for r in rows)

    def kind_exists(self, kind: str) -> bool:
        stmt = fs.kind_exists()
        return bool(self._store.transaction(self._store.durable, lambda c: c.execute(stmt, {"of_kind": kind}).scalar()))

    def held_keys(self, kind: str) -> list[str | None]:
        rows = self._store.transaction(self._store.durable, lambda c: c.execute(fs.held_keys(), {"of_kind": kind}).all())
        return [r.concurrency_key for r in rows]

    # --- what operators see --------------------------------------------------------

    def overview(self, tenant: str | None = None) -> dict[str, Any]:
        """Declared limits, pauses, and active jobs per (kind, key, status, held)."""

        def work(conn: Connection) -> dict[str, Any]:
            return {
                "limits": [dict(r) for r in conn.execute(fs.list_limits()).mappings()],
                "pauses": [dict(r) for r in conn.execute(fs.list_pauses()).mappings()],
                "counts": [tuple(r) for r in conn.execute(fs.flow_counts(tenant))],
            }

        return self._store.transaction(self._store.durable, work)
