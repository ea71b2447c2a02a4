"""The store's claims (see :mod:`celery_lease.db.statements.claim`): the claim of a
delivery, with riding successes, and what settles a claim whose reply was lost.

A part of :class:`~celery_lease.db.store.Store` (its base).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from celery_lease.db.prepared import Prepared
from celery_lease.db.statements import claim
from celery_lease.errors import DatabaseUnavailable
from celery_lease.status import Event, Status

log = logging.getLogger("celery_lease")


@dataclass(eq=False)
class RidingSuccesses:
    """complete_jobs parameters for ``count`` attempts, sent with a claim. ``done``: the ids
    completed (those that landed before a lost reply too), or None if sent without them."""

    params: dict[str, Any]
    count: int
    done: set[str] | None = None


class ClaimLanded(Exception):
    """A claim's first try had landed before its reply was lost: ``row`` is adopted."""

    def __init__(self, row: dict[str, Any]) -> None:
        super().__init__("claim landed")
        self.row = row


class LandedClaim:
    """Called before a claim is retried after a lost reply (and when the retry claimed
    nothing): the job the first try claimed is running under this ``owner``: the
    delivered job, or (a priority swap) another of its kind. claim.adopt_claim finds
    it; it is adopted (ClaimLanded is raised with its row, which ends the retries) if
    ``may_adopt(its id, its generation)``: no attempt of it lives in this process and
    no other claim is in progress here (the owner is one process), so the row can only
    be that claim's. Without ``may_adopt`` nothing is adopted."""

    def __init__(self, store: Any, job_id: str, owner: str, may_adopt: Callable[[str, int], bool] | None) -> None:
        self._store, self._may_adopt = store, may_adopt
        self._params = {"job_id": job_id, "owner": owner}
        self.retried = False

    def __call__(self) -> None:
        self.retried = True
        if self._may_adopt is None:
            return
        stmt = claim.adopt_claim()
        try:
            rows = self._store.transaction(
                self._store.engine(single=True), lambda c: [dict(r) for r in c.execute(stmt, self._params).mappings()]
            )
        except DatabaseUnavailable:
            return  # still unreachable: the retry finds out
        for row in rows:
            if self._may_adopt(str(row["id"]), row["lease_generation"]):
                log.warning("celery-lease: job %s: its claim had landed before the reply was lost; adopted", row["id"])
                raise ClaimLanded(row)


class Claims:
    """Claims on a :class:`~celery_lease.db.engine.Database` (with Store's
    ``log_events`` and ``landed_successes``)."""

    dialect: str
    _prepared: dict[str, Prepared] | None
    durable: Any
    engine: Any
    transaction: Any
    execute_prepared: Any
    log_events: Any
    landed_successes: Any

    def claim(
        self,
        job_id: str,
        owner: str,
        task: str,
        *,
        may_adopt: Callable[[str, int], bool] | None = None,
        successes: RidingSuccesses | None = None,
    ) -> dict[str, Any] | None:
        """Claim a job for one attempt (statements.claim); None when the delivery is a
        duplicate, names a job of another task than the one it was delivered to, or
        flow control refuses it (celery_lease.flow tells which). The row's id is the job
        claimed: a higher-priority job of the same kind may be claimed instead. A row
        whose ``status`` is ``cancelled`` is a job the claim found in a cancelled run
        (and cancelled): it must not start.

        A claim whose reply was lost (a dropped connection) may have landed; before it
        is retried, and when the retry claims nothing, the job it claimed is adopted
        (:meth:`landed_claim`), instead of being left running with no body until its
        lease expires.

        With ``successes`` (PostgreSQL, prepared statements), they are written by the
        same statement; see :class:`RidingSuccesses` for what the caller learns.
        """
        params = {"job_id": job_id, "owner": owner, "wakeup_task": task}
        check = self.landed_claim(job_id, owner, may_adopt)
        try:
            row: Any
            if self._prepared is not None:
                rows = None if successes is None else self._claim_completing(params, successes, check)
                if rows is None:
                    rows = self.execute_prepared(self._prepared["claim"], params, on_retry=check)
                row = rows[0] if rows else None
            elif self.dialect == "postgresql":
                stmt = claim.claim()
                row = self.transaction(
                    self.engine(single=True), lambda conn: conn.execute(stmt, params).mappings().first(), on_retry=check
                )
            else:

                def work(conn):
                    # The job claimed may be another than job_id (a priority swap).
                    claimed = conn.execute(claim.claim(logged=False), params).mappings().first()
                    if claimed is not None:
                        run_cancelled = claimed["status"] == Status.CANCELLED.value
                        event, detail = (Event.CANCELLED, claim.RUN_CANCELLED) if run_cancelled else (Event.CLAIMED, owner)
                        self.log_events(conn, [(claimed, event, detail)])
                    return claimed

                row = self.transaction(self.durable, work, on_retry=check)
            if row is None and check.retried:
                check()  # the retry claimed nothing: the first try may have
        except ClaimLanded as landed:
            row = landed.row
        return None if row is None else dict(row)

    def landed_claim(self, job_id: str, owner: str, may_adopt: Callable[[str, int], bool] | None) -> LandedClaim:
        """What a claim retried after a lost reply runs first (see LandedClaim)."""
        return LandedClaim(self, job_id, owner, may_adopt)

    def _claim_completing(self, params: dict[str, Any], successes: RidingSuccesses, check: LandedClaim) -> list[dict] | None:
        """The claim with ``successes`` riding on it; None when the statement failed on
        something else than a lost database (a value it refused): the claim is then sent
        alone, and ``successes.done`` stays None."""
        assert self._prepared is not None
        key = f"claim_complete_{successes.count}"
        stmt = self._prepared.get(key) or self._prepared.setdefault(key, Prepared(claim.claim(riding=successes.count)))
        keys = [(str(successes.params[f"job_id_{i}"]), successes.params[f"generation_{i}"]) for i in range(successes.count)]
        try:
            (row,) = self.execute_prepared(stmt, {**params, **successes.params}, on_retry=check)
        except ClaimLanded:
            # The first try landed whole: its claim and the successes it wrote.
            successes.done = self._landed_or_none(keys)
            raise
        except DatabaseUnavailable:
            raise
        except Exception:
            log.warning("celery-lease: a claim carrying %d success(es) failed; claiming alone", successes.count, exc_info=True)
            return None
        done = set(row.pop("completed") or ())
        if check.retried and len(done) < successes.count:
            done |= self._landed_or_none([k for k in keys if k[0] not in done])
        successes.done = done
        return [] if row["id"] is None else [row]

    def _landed_or_none(self, keys: list[tuple[str, int]]) -> set[str]:
        try:
            return self.landed_successes(keys)
        except DatabaseUnavailable:
            return set()  # the caller re-checks each missing one (fenced), which settles it
