"""Flow control's claim and release on PostgreSQL, statement by statement: each test
sets rows up directly (make_job) and runs the store's transactions as a worker does."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from celery_lease.db.schema import jobs
from celery_lease.flow.limits import Limits, Rate
from celery_lease.status import Held

OWNER = "n/1/b"


@pytest.fixture(params=[True, False], ids=["prepared", "unprepared"])
def flow(request, pg):
    from celery_lease.db.store import Store
    from celery_lease.flow.store import FlowStore

    store = Store(pg, prepare_statements=request.param)
    yield FlowStore(store, prepare=request.param)
    store.dispose()


def held_jobs(pg, make_job, n: int, reason: Held, kind: str = "k") -> list[str]:
    """n pending jobs of ``kind`` held for ``reason``, inserted after the table's
    statistics were taken with none held (as autovacuum leaves them when a backlog
    builds up quickly): the planner then expects the held jobs to be few."""
    engine = sa.create_engine(pg, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.exec_driver_sql("ANALYZE celery_lease_jobs")
    engine.dispose()
    return [make_job(pg, kind=kind, task="t", held=reason.value) for _ in range(n)]


def statuses(pg, ids) -> dict[str, tuple[str, str | None]]:
    engine = sa.create_engine(pg)
    with engine.connect() as conn:
        rows = conn.execute(sa.select(jobs.c.id, jobs.c.status, jobs.c.held).where(jobs.c.id.in_(ids))).all()
    engine.dispose()
    return {str(r.id): (r.status, r.held) for r in rows}


def test_one_freed_slot_wakes_one_of_200_held_jobs(pg, make_job, flow):
    """concurrency=1, one job held by the limit for each of 200: a release with the slot
    free wakes exactly one (the `id IN (SELECT ... LIMIT ... SKIP LOCKED)` plan woke 199)."""
    limits_ = Limits(concurrency=1)
    first = make_job(pg, kind="k", task="t")
    assert flow.claim_limited(first, OWNER, "k", "t", limits_).row is not None  # creates the limits row
    ids = held_jobs(pg, make_job, 200, Held.LIMIT)
    engine = sa.create_engine(pg)
    with engine.begin() as conn:
        conn.execute(sa.update(jobs).where(jobs.c.id == first).values(status="succeeded"))
    engine.dispose()
    woken = flow.wake_for_slot("k", None)
    assert len(woken) == 1
    assert sum(1 for status, held in statuses(pg, ids).values() if held is None) == 1


def test_a_rate_window_with_budget_n_wakes_n_held_jobs(pg, make_job, flow):
    """A claim that opens a window of rate 3 wakes 2 jobs held for the rate (it woke 7)."""
    rate = Limits(rate=Rate(3, 3600))
    first = make_job(pg, kind="k", task="t")
    ids = held_jobs(pg, make_job, 200, Held.RATE)
    result = flow.claim_limited(first, OWNER, "k", "t", rate)
    assert result.row is not None and result.row["window_claims"] == 1
    assert len(result.wake) == 2
    assert sum(1 for status, held in statuses(pg, ids).values() if held is None) == 2
