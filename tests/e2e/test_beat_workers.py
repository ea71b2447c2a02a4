"""beat's ticks through real `celery worker` processes, real PostgreSQL and a private
Redis: a tick's slot key is derived from the schedule, never taken from the message."""

from __future__ import annotations

import time

import sqlalchemy as sa

from celery_lease.db.schema import jobs
from tests.conftest import wait_for

APP = "tests.apps.app_unstorable"


def _all_rows(db: str) -> list[dict]:
    engine = sa.create_engine(db)
    try:
        with engine.connect() as conn:
            return [dict(r) for r in conn.execute(sa.select(jobs)).mappings()]
    finally:
        engine.dispose()


def test_a_beat_ticks_slot_key_is_derived_from_the_schedule(pg, broker, client_app, workers):
    """Before, the worker took the idempotency key from the tick's arguments: a forged
    tick could claim next year's slot (so it never runs) or any key at all."""
    mod = client_app(pg, broker, module=APP)
    w = workers(pg, broker, module=APP)
    now = time.time()
    forged = [
        ("bnd-tick", "beat:bnd-tick:2099-01-01T00:00:00+00:00"),  # a future slot's key
        ("bnd-tick", "anything-at-all"),  # not a slot key
        ("bnd-tick", now + 86400),  # a tick from tomorrow
        ("bnd-tick", 0.0),  # a tick from 1970
        ("bnd-tick", float("nan")),
        ("no-such-entry", now),
        ("bnd-tick",),  # a tick with no time
    ]
    for args in forged:
        mod.app.send_task("celery_lease.beat_submit", args=args)
    wait_for(lambda: w.log().count("refused: ") >= len(forged), timeout=30, what="every forged tick refused")
    assert _all_rows(pg) == []

    # A real tick submits its own slot's job; a tick of an older beat (which sent the
    # key) for that same slot is accepted because it is exactly that slot's key.
    tick = time.time()
    entry = mod.leases.beat_jobs.entry("bnd-tick")
    mod.app.send_task("celery_lease.beat_submit", args=("bnd-tick", tick))
    mod.app.send_task("celery_lease.beat_submit", args=("bnd-tick", entry.slot_key(tick)))
    wait_for(lambda: w.log().count("'key': 'beat:bnd-tick:") >= 2, timeout=30, what="both ticks submitted")
    rows = _all_rows(pg)
    assert [r["idempotency_key"] for r in rows] == [entry.slot_key(tick)]
    assert w.log().count("refused: ") == len(forged)
