"""Every claim, named once, and the one function that executes them all, of one job or
many (:func:`claim_rows`; :func:`execute` for a named claim of one job).

Rules: its statement is the catalogue's and declared durable there (the generation it
issues is a fencing token never issued twice, also across a crash); a lost reply is
settled by identity: each claim writes its own ``claim_token``, and a retry first adopts
the rows running under its owner with that token (:class:`LandedClaim`), never another
row of the owner; follow-ups (:class:`ClaimFollowUps`) run once after the commit that
counts, each best-effort. No Landing: a claim is one statement alone in its transaction,
one round trip where a Landing costs three (docs/lifecycle.md, "The claims").
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from celery_lease.db import durability
from celery_lease.db.outage import retry_briefly
from celery_lease.db.statements import claim
from celery_lease.db.statements import flow as fs
from celery_lease.db.statements.events import logs_itself
from celery_lease.errors import DatabaseUnavailable
from celery_lease.status import Event, Status

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

    from celery_lease.db.store import Store

log = logging.getLogger("celery_lease")

Row = dict[str, Any]
_CANCELLED = Status.CANCELLED.value


@dataclass(frozen=True)
class Claim:
    #: Its name in logs and docs (docs/lifecycle.md).
    name: str
    #: Builds the statement: ``statement(dialect, **build)``.
    statement: Callable[..., Any]
    #: Takes its kind's limits row lock first, in the same transaction (one script,
    #: prepared): flow control's limits are checked under it.
    limited: bool = False


#: The claim of a kind with no limit: one statement; on PostgreSQL it appends its run
#: event itself (on SQLite, the same transaction does). Every claim swaps in a due
#: higher-priority job of the kind, queue and key, and refuses a paused kind.
CLAIM = Claim("claim", lambda dialect: claim.claim(dialect))
#: The claim of a limited kind (``concurrency``, ``rate``): under its limits row lock,
#: only while a slot is free and the rate window takes it (counted by the statement).
CLAIM_LIMITED = Claim(
    "limited claim",
    lambda dialect, concurrency, rate: claim.claim(dialect, concurrency=concurrency, rate=rate),
    limited=True,
)
#: A claim whose reply was lost may have landed: the job it claimed, running under the
#: same owner with the claim's own token, gets its lease restarted and is adopted
#: (LandedClaim).
ADOPT = Claim("adopt a landed claim", lambda dialect: claim.adopt_claim())

#: Every claim, for docs/lifecycle.md and the tests that hold them to the rules above.
ALL = (CLAIM, CLAIM_LIMITED, ADOPT)


@dataclass(frozen=True)
class ClaimFollowUps:
    """What a committed claim sets off, each called with the claimed row, after the
    commit, once (also when the row came from a first try whose reply was lost), each
    best-effort: a failure is logged and never fails the delivery (its job would stay
    running with no body)."""

    #: The claim took the row to run: called before the others (the worker starts the
    #: attempt's heartbeat here, so a follow-up held by a slow broker or database does
    #: not hold the new lease unrenewed).
    claimed: Callable[[Row], None] | None = None
    #: The claim found the job's run cancelled and cancelled it: its errbacks fire and
    #: a chord it heads is removed (Pipeline.claim_cancelled). It took no slot.
    cancelled: Callable[[Row], None] | None = None
    #: The claim opened its kind's rate window: the jobs held for it are woken.
    window_opened: Callable[[Row], None] | None = None
    #: The claim took another job than the delivered one (a priority swap): the
    #: delivered job gets a new wakeup.
    swapped: Callable[[Row], None] | None = None


def new_token() -> int:
    """A claim's identity (``claim_token``): random, so no other claim, of this process
    or any, writes the same one; what its retries and their adoption look for."""
    return secrets.randbits(63)


class ClaimLanded(Exception):
    """A claim's first try had landed before its reply was lost: ``rows`` (what it
    claimed, found by its token) are adopted."""

    def __init__(self, rows: list[Row]) -> None:
        super().__init__("claim landed")
        self.rows = rows


def landed_rows(store: Store, conn: Connection, params: Mapping[str, Any]) -> list[Row]:
    """The rows a claim's first try took, if it landed: running under its ``owner`` with
    its ``claim_token`` (ADOPT restarts their leases)."""
    rows = [dict(r) for r in conn.execute(ADOPT.statement(store.dialect), dict(params)).mappings()]
    if rows:
        log.warning("celery-lease: job(s) %s: claimed before the reply was lost; adopted", ", ".join(str(r["id"]) for r in rows))
    return rows


class LandedClaim:
    """Called before a claim is retried after a lost reply (and when the retry claimed
    nothing): the row the first try claimed, if it landed, is running under this owner
    with this claim's token; it is adopted (ClaimLanded is raised with it, which ends
    the retries)."""

    def __init__(self, store: Store, params: Mapping[str, Any]) -> None:
        self._store = store
        self._params = {"owner": params["owner"], "token": params["token"]}
        self.retried = False

    def __call__(self) -> None:
        self.retried = True
        try:
            rows = self.landed()
        except DatabaseUnavailable:
            return  # still unreachable: the retry finds out
        if rows:
            raise ClaimLanded(rows)

    def landed(self) -> list[Row]:
        """The rows the first try took (adopted), or none; DatabaseUnavailable when the
        server cannot be asked."""
        store = self._store
        return store.transaction(store.engine(single=True), lambda c: landed_rows(store, c, self._params))


def execute(
    store: Store,
    t: Claim,
    params: Mapping[str, Any],
    *,
    build: Mapping[str, Any] | None = None,
    follow_ups: ClaimFollowUps | None = None,
) -> Row | None:
    """Execute the claim ``t`` of the job ``params`` names (job_id, owner, wakeup_task,
    and a limited claim's limits); return the row claimed, or None when nothing was
    (a duplicate delivery, one for another task, or a limit, rate or pause refused it).
    A row whose ``status`` is ``cancelled`` is a job the claim found in a cancelled run
    (and cancelled): it must not start. A statement that does not log itself (SQLite)
    has its run event (and its rate window's count) written in its transaction."""
    build = build or {}
    stmt = t.statement(store.dialect, **build)
    then = None if logs_itself(stmt) else partial(_log, store, t, params, bool(build.get("rate")))
    rows, _ = claim_rows(store, stmt, params, limited=t.limited, then=then)
    row = rows[0] if rows else None  # (a single claim takes one row)
    if row is not None and follow_ups is not None:
        _after(t, row, params, follow_ups)
    return row


def claim_rows(
    store: Store, stmt: Any, params: Mapping[str, Any], *, limited: bool, then: Callable[..., list[Row]] | None = None
) -> tuple[list[Row], bool]:
    """Every claim, of one job or many (lifecycle/many_claim.py), is executed here: alone
    in its transaction (prepared, one round trip; a ``limited`` one after its kind's
    limits row lock; ``then``: Store.alone's), its lost reply settled by its token
    (LandedClaim). Returns its rows and whether they were adopted from a first try whose
    reply was lost (then they carry only ADOPT's columns).

    A claim whose retry found the server gone (a backend crash resets every connection,
    and the server refuses them while it recovers) asks again through a short outage
    (retry_briefly) whether its first try landed, and runs once more only if it did not.
    Left unasked, a landed claim's job ran no body until the reaper spent its attempt
    (history[prepared] seed 639886)."""
    assert durability.is_durable(stmt), "a claim's statement must be declared durable"
    params = {**params, "token": new_token()}
    check = LandedClaim(store, params)
    lock = fs.lock_limits(store.dialect) if limited else None

    def run() -> list[Row]:
        return store.alone(stmt, params, lock=lock, on_retry=check, then=then)

    try:
        try:
            rows = run()
            if check.retried and all(r["id"] is None for r in rows):
                check()  # the retry claimed nothing: the first try may have
            return rows, False
        except DatabaseUnavailable:
            if not check.retried:
                raise
            rows = retry_briefly(check.landed)
            return (rows, True) if rows else (run(), False)
    except ClaimLanded as landed:
        return landed.rows, True


def _log(store: Store, t: Claim, params: Mapping[str, Any], rated: bool, conn: Connection, rows: list[Row]) -> list[Row]:
    """The claimed row's run event, and its rate window's count, in its transaction."""
    for claimed in rows:
        cancelled = claimed["status"] == _CANCELLED
        event, detail = (Event.CANCELLED, claim.RUN_CANCELLED) if cancelled else (Event.CLAIMED, params["owner"])
        store.log_events(conn, [(claimed, event, detail)])
        if t.limited:
            window = conn.execute(fs.count_rate_claim(), params).mappings().first() if rated and not cancelled else None
            claimed["window_claims"], claimed["window_rate"] = (None, None) if window is None else tuple(window.values())
    return rows


def _after(t: Claim, row: Row, params: Mapping[str, Any], f: ClaimFollowUps) -> None:
    """The follow-ups of one committed claim, each once, each best-effort."""
    steps: list[tuple[str, Callable[[Row], None] | None]] = []
    if row["status"] == _CANCELLED:
        steps.append(("errbacks of its cancel", f.cancelled))
    else:
        steps.append(("start of its attempt", f.claimed))
        if t.limited and row.get("window_claims") == 1:
            steps.append(("wake of its new rate window", f.window_opened))
    if str(row["id"]) != str(params["job_id"]):
        steps.append(("new wakeup of the job it swapped out", f.swapped))
    for what, step in steps:
        if step is None:
            continue
        try:
            step(row)
        except Exception:
            log.exception("celery-lease: job %s: the %s after its %s failed", row["id"], what, t.name)


def claim_delivery(
    store: Store,
    job_id: str,
    owner: str,
    task: str,
    *,
    follow_ups: ClaimFollowUps | None = None,
) -> Row | None:
    """The claim of a delivery of a kind with no limit (CLAIM)."""
    params = {"job_id": job_id, "owner": owner, "wakeup_task": task}
    return execute(store, CLAIM, params, follow_ups=follow_ups)
