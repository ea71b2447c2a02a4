"""The transitions of a batched kind (``batch=N``): many rows moved by one statement.

Executed by :meth:`celery_lease.lifecycle.pipeline.Pipeline.execute` like every other
transition: durable (declared on the statement), one transaction through a Landing, so
a claim or completion whose reply was lost is found committed (its rows are returned
from that first try) or run again, never both.

Neither is ``fenced`` as a whole: each row carries its own guard (a claim: pending and
due; a completion: its own job id, generation and ``running``), and a row that misses
its guard leaves the others moved. The caller decides what a missing row means
(worker/batch.py). Neither frees a flow-control slot: a batched kind has no limits
(``@leases.job`` refuses ``batch`` with ``concurrency`` or ``rate_limit``).
"""

from __future__ import annotations

from celery_lease.db.statements import batch
from celery_lease.lifecycle.transition import Transition
from celery_lease.status import Event

#: pending -> running for up to :n due jobs of a kind and queue (or cancelled, for a
#: job of a cancelled run); the statement appends the run events itself.
CLAIM_BATCH = Transition(
    "claim (batch)",
    lambda dialect: batch.claim_batch(),
    Event.CLAIMED,
    releases=False,
    self_logged=frozenset({"postgresql"}),
)
#: running -> succeeded for many attempts, each fenced by its own generation.
SUCCEED_BATCH = Transition(
    "succeed (batch)",
    lambda dialect, count: batch.complete_batch(count),
    Event.SUCCEEDED,
    releases=False,
)
