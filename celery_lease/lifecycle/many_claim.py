"""The many-job claim: up to N rows moved by one statement (every kind that
claims what is due, worker/many_claim.py), CLAIM_MANY or, for a limited kind, CLAIM_MANY_LIMITED
after its limits row lock in the same transaction.

Executed as every claim (lifecycle.claim.claim_rows): durable, one statement alone in
its transaction, a lost reply settled by the claim's token, so a claim whose reply was
lost is found committed (its rows adopted) or run again, never both. Not ``fenced`` as a
whole: each row carries its own guard (pending and due), and the caller decides what a
missing row means. It frees no flow-control slot.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from celery_lease.db.statements import many_claim
from celery_lease.lifecycle.claim import claim_rows
from celery_lease.lifecycle.transition import Transition
from celery_lease.status import Event

if TYPE_CHECKING:
    from celery_lease.db.store import Store

#: pending -> running for up to :n due jobs of a kind and queue (or cancelled, for a
#: job of a cancelled run); the statement appends the run events itself.
CLAIM_MANY = Transition(
    "many-job claim",
    lambda dialect: many_claim.claim_many(),
    Event.CLAIMED,
    releases=False,
)
#: The same for a limited kind, under its limits row lock: also takes ``of_kind`` and
#: the limits its code declares (new_concurrency, new_rate, new_per_seconds).
CLAIM_MANY_LIMITED = Transition(
    "limited many-job claim",
    lambda dialect: many_claim.claim_many_limited(),
    Event.CLAIMED,
    releases=False,
)


def claim_many(store: Store, params: Mapping[str, Any], *, limited: bool = False) -> list[dict[str, Any]]:
    """Execute CLAIM_MANY (``limited``: CLAIM_MANY_LIMITED) for ``params`` (job_id,
    wakeup_task, owner, n, a limited one's limits); return its rows (one row of NULLs
    but ``paused`` / ``overridden`` when nothing was claimed).

    As every claim (lifecycle.claim.claim_rows): one statement alone in its
    transaction, and a lost reply settled by identity, the rows running under this owner
    with this claim's token adopted, never other rows. Blindly re-run, the claim took
    other rows and left the first try's running with no body until the reaper spent
    their attempt."""
    t = CLAIM_MANY_LIMITED if limited else CLAIM_MANY
    rows, adopted = claim_rows(store, t.statement(store.dialect), params, limited=limited)
    if not adopted:
        return rows
    # ``next_id`` is not known: what is left of the kind waits for the sweeper.
    unknown = {"held_rate": 0, "window_claims": None, "window_rate": None, "opened": False, "next_queue": None}
    return [{**row, "next_id": None, "paused": False, "overridden": False, **unknown} for row in rows]
