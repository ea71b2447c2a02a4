"""How long a write is retried while the database is away: a short outage (a restart, a
failover, a dropped pool) costs a pause, not the work. The one place above the driver
that decides it; code above ``db/`` retries through these two and never counts its own
waits (tests/unit/test_database_boundary.py)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from celery_lease.errors import DatabaseUnavailable, LeaseLost

log = logging.getLogger("celery_lease")

T = TypeVar("T")

#: Seconds between tries of a write while the database is unreachable (the last repeats):
#: an attempt's writes try until its lease lapses by its own clock, others for their sum.
OUTAGE_WAITS = (0.1, 0.25, 0.5, 1.0)


def retry_within_lease(
    write: Callable[[], T],
    lapsed: Callable[[], bool],
    *,
    lapses_at: Callable[[], float] | None = None,
    on_retry: Callable[[], None] | None = None,
    what: str,
) -> T:
    """Run ``write`` (the writes of live attempts); while the database is unreachable,
    try again, OUTAGE_WAITS apart (the last repeating; never sleeping past ``lapses_at()``),
    until ``lapsed()``: then LeaseLost. A short outage (a restart, a failover) costs a
    pause, not the attempt. ``on_retry`` is told of each new try (the last may have
    landed before its reply was lost); ``what`` names the write in the log."""
    waits = iter(OUTAGE_WAITS)
    while True:
        if lapsed():
            raise LeaseLost()
        try:
            return write()
        except DatabaseUnavailable:
            log.warning("celery-lease: %s: database unavailable; trying again within the lease", what)
            if on_retry is not None:
                on_retry()
            wait = next(waits, OUTAGE_WAITS[-1])
            time.sleep(wait if lapses_at is None else max(0.0, min(wait, lapses_at() - time.monotonic())))


def retry_briefly(write: Callable[[], T]) -> T:
    """A write of no attempt (a cancel, maintenance, a claim settling a lost reply):
    tried again through a short outage, then DatabaseUnavailable reaches the caller."""
    for wait in OUTAGE_WAITS:
        try:
            return write()
        except DatabaseUnavailable:
            log.warning("celery-lease: database unavailable; trying the transition again in %ss", wait)
            time.sleep(wait)
    return write()
