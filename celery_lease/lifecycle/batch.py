"""The claim of a batched kind (``batch=N``): up to N rows moved by one statement.

Executed by :meth:`celery_lease.lifecycle.pipeline.Pipeline.execute` like every other
transition: durable (declared on the statement), one transaction through a Landing, so
a claim whose reply was lost is found committed (its rows are returned from that first
try) or run again, never both. (A batch's successes are the completer's statement:
worker/batch.py.)

Not ``fenced`` as a whole: each row carries its own guard (pending and due), and the
caller decides what a missing row means (worker/batch.py). It frees no flow-control
slot. A limited kind's (a limit in code or an operator's override) is
CLAIM_BATCH_LIMITED: the kind's limits row is locked first in the same transaction
(flow.lock_limits, as the single limited claim), then one statement bounds the batch
by the limits in force.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from celery_lease.db.statements import batch
from celery_lease.db.statements import flow as fs
from celery_lease.lifecycle.claim import ClaimLanded, landed_rows, new_token
from celery_lease.lifecycle.transition import Transition
from celery_lease.status import Event

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

    from celery_lease.db.store import Store
    from celery_lease.lifecycle.pipeline import Pipeline

#: pending -> running for up to :n due jobs of a kind and queue (or cancelled, for a
#: job of a cancelled run); the statement appends the run events itself.
CLAIM_BATCH = Transition(
    "claim (batch)",
    lambda dialect: batch.claim_batch(),
    Event.CLAIMED,
    releases=False,
)
#: The same for a limited kind, under its limits row lock: also takes ``of_kind`` and
#: the limits its code declares (new_concurrency, new_rate, new_per_seconds).
CLAIM_BATCH_LIMITED = Transition(
    "limited claim (batch)",
    lambda dialect: batch.claim_batch_limited(),
    Event.CLAIMED,
    releases=False,
)


def claim_batch(pipeline: Pipeline, store: Store, params: Mapping[str, Any], *, limited: bool = False) -> list[dict[str, Any]]:
    """Execute CLAIM_BATCH (``limited``: CLAIM_BATCH_LIMITED) for ``params`` (job_id,
    wakeup_task, owner, n) under a new claim token; return its rows (one row of NULLs
    but ``paused`` when nothing was claimed).

    A re-run adopts by identity: when the first try's reply was lost and the Landing
    cannot tell whether it committed (the server restarted since), the claim runs
    again; before it does, in its transaction, the rows running under this owner with
    this claim's token are looked for, and if the first try had landed they are the
    result (ClaimLanded ends the re-run, which claims nothing more). Blindly re-run, the
    claim took other rows and left the first try's running with no body until the
    reaper spent their attempt. The first try pays nothing for this."""
    params = {**params, "token": new_token()}
    tries = 0

    def adopt_on_rerun(conn: Connection) -> None:
        nonlocal tries
        if limited:  # first: the lock order of flow control (limits row, then job rows)
            conn.execute(fs.lock_limits(store.dialect), params)
        tries += 1
        if tries > 1:
            rows = landed_rows(store, conn, params)
            if rows:
                raise ClaimLanded(rows)

    try:
        return pipeline.execute(CLAIM_BATCH_LIMITED if limited else CLAIM_BATCH, params, before=adopt_on_rerun)
    except ClaimLanded as landed:
        # (Raised inside the re-run's transaction: the lease restarts roll back; the
        # leases stand from the first try, after the moment the attempts count from.
        # ``next_id`` is not known: what is left of the kind waits for the sweeper.)
        unknown = {"held_rate": 0, "window_claims": None, "window_rate": None, "opened": False, "next_queue": None}
        return [{**row, "next_id": None, "paused": False, **unknown} for row in landed.rows]
