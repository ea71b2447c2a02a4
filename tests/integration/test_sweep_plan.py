"""The sweep reads what it sends, not the backlog (issue #12): PostgreSQL's own plans.

A sweep tick runs queries.claim_due_wakeups as a prepared statement (db/store.py), so
PostgreSQL may run it with a custom plan or, after a few runs, a generic one. Both are
asked for here, with statistics taken before the backlog existed (the planner then
knows nothing of it), and must read a handful of index entries whatever the backlog:
the figures asserted are rows the plan visited, not times.
"""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa

from celery_lease.db import queries as q
from celery_lease.db.prepared import Prepared

#: Pending jobs whose wakeup was just published (the sweeper must send none of them),
#: delayed jobs due in an hour (nor them), and jobs it must wake.
FRESH, DELAYED = 20_000, 5_000
_COLUMNS = "(id, kind, task, status, attempt, max_attempts, lease_seconds, payload, created_at, updated_at, run_after, woken_at)"
_FILL = (
    f"INSERT INTO celery_lease_jobs {_COLUMNS} SELECT gen_random_uuid(), 'echo', 'tests.apps.app.echo', 'pending', 0, 3, 30,"
    " '{{}}'::jsonb, now(), now(), {run_after}, {woken_at} FROM generate_series(1, {rows})"
)
DUE = {  # (run_after, woken_at) of each kind of due job, 3 of each
    "never woken": ("NULL", "NULL"),
    "came due": ("now() - interval '1 minute'", "NULL"),
    "stale": ("NULL", "now() - interval '1 hour'"),
}


def _visited(plan: dict) -> int:
    """Rows every scan node of the plan returned or filtered out, over all its loops."""
    own = 0
    if "Scan" in plan["Node Type"] and plan.get("Relation Name") == "celery_lease_jobs":
        own = (plan["Actual Rows"] + plan.get("Rows Removed by Filter", 0)) * plan["Actual Loops"]
    return own + sum(_visited(p) for p in plan.get("Plans", []))


def _scans(plan: dict) -> list[tuple[str, str | None]]:
    own = [(plan["Node Type"], plan.get("Index Name"))] if plan.get("Relation Name") == "celery_lease_jobs" else []
    return own + [s for p in plan.get("Plans", []) for s in _scans(p)]


@pytest.mark.parametrize("mode", ["force_custom_plan", "force_generic_plan"])
def test_sweep_plan_reads_the_due_rows_not_the_backlog(pg, mode):
    engine = sa.create_engine(pg)
    prepared = Prepared(q.claim_due_wakeups("postgresql"))
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql("ANALYZE celery_lease_jobs")  # statistics of an empty table
            conn.exec_driver_sql(_FILL.format(run_after="NULL", woken_at="now()", rows=FRESH))
            conn.exec_driver_sql(_FILL.format(run_after="now() + interval '1 hour'", woken_at="NULL", rows=DELAYED))
            for run_after, woken_at in DUE.values():
                conn.exec_driver_sql(_FILL.format(run_after=run_after, woken_at=woken_at, rows=3))
        with engine.connect() as conn:
            raw = conn.connection.dbapi_connection
            with raw.cursor() as cur:
                cur.execute(f"SET plan_cache_mode = {mode}")
                cur.execute(prepared.prepare_sql)
                execute = "EXPLAIN (ANALYZE, FORMAT JSON) " + prepared.execute_sql
                cur.execute(execute, prepared.values({"stale_seconds": 30.0, "limit": 100}))
                (plan,) = cur.fetchone()[0]
                cur.execute("SELECT count(*) FROM celery_lease_jobs WHERE woken_at > now() - interval '1 minute'")
                (stamped,) = cur.fetchone()
            raw.rollback()
    finally:
        engine.dispose()
    plan = plan if isinstance(plan, dict) else json.loads(plan)
    root = plan["Plan"]
    assert root["Actual Rows"] == 3 * len(DUE), "every due job is woken, nothing else"
    assert stamped == FRESH + 3 * len(DUE)
    scans = _scans(root)
    assert ("Seq Scan", None) not in scans, scans
    assert scans.count(("Index Scan", "celery_lease_jobs_wakeup")) == 3, scans
    # Each due row is read by its range and by the UPDATE's primary-key probe; the
    # 25,000 rows of the backlog not at all.
    assert _visited(root) <= 2 * 3 * len(DUE) + 3, json.dumps(root, indent=1)
