"""The sweeper's re-sends back off: a wakeup that stays unclaimed is far more often
queued behind a broker backlog than lost, and re-sending it every threshold fed the
backlog it waited behind (celery_lease/db/statements/maintenance.py, _resend_due)."""

from __future__ import annotations

import time

#: The staleness threshold of these tests (seconds).
STALE = 0.5


def _resends(store, job_id: str, seconds: float) -> list[float]:
    """When (seconds from now) the sweeper re-sent ``job_id``'s wakeup, sweeping every 50 ms."""
    out: list[float] = []
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        if any(str(r["id"]) == job_id for r in store.claim_due_wakeups(STALE, 100)):
            out.append(round(time.monotonic() - started, 2))
        time.sleep(0.05)
    return out


def test_a_wakeup_nobody_claims_is_resent_after_one_threshold_then_at_doubling_intervals(pg, client_app):
    """Nothing consumes the memory broker: the job's wakeup stays queued. Re-sent every
    threshold, it would be sent 7 times in 3.6 s; backing off, after 0.5, 1 and 2 s
    (the job's wait when last woken, at most 4 thresholds)."""
    mod = client_app(pg, "memory://")
    job = mod.echo.submit({"value": 1})
    resent = _resends(mod.leases.store, job.id, 3.6)
    assert 2 <= len(resent) <= 4, resent
    assert resent[0] < 1.5, "the first re-send still comes after one threshold"


def test_resends_back_off_no_further_than_four_thresholds(pg, client_app):
    """A job woken long after it became pending (held by a limit for an hour, say) is
    re-sent after at most 4 thresholds, not after its whole wait."""
    import sqlalchemy as sa

    mod = client_app(pg, "memory://")
    job = mod.echo.submit({"value": 1})
    engine = sa.create_engine(pg)
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE celery_lease_jobs SET updated_at = now() - interval '1 hour' WHERE id = :id"), {"id": job.id}
        )
    engine.dispose()
    resent = _resends(mod.leases.store, job.id, 2.6)
    assert len(resent) == 1 and 1.9 <= resent[0] <= 2.6, resent
