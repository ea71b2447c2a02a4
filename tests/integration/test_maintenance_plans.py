"""Sweep and reap read what they change, not the backlog (issue #12): PostgreSQL's own plans.

Both run as prepared statements (db/store.py), so PostgreSQL may run them with a custom
plan or, after a few runs, a generic one. Both are asked for here, with statistics
taken before the backlog existed (the planner then knows nothing of it), and must read
the rows they change and a few index entries whatever the backlog: the figures
asserted are rows the plan visited, not times.
"""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa

from celery_lease.db import durability
from celery_lease.db.prepared import Prepared
from celery_lease.db.statements import maintenance

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


def _explain(pg: str, mode: str, stmt, params: dict, fills: list[str], *, analyzed: bool = False) -> tuple[dict, int]:
    """EXPLAIN ANALYZE of the prepared statement under ``mode``, after ``fills``, rolled
    back; with the rows changed in the last minute. The statistics are those of an
    empty table, or of the filled one when ``analyzed``."""
    engine = sa.create_engine(pg)
    prepared = Prepared(stmt)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql("ANALYZE celery_lease_jobs")
            for fill in fills:
                conn.exec_driver_sql(fill)
            if analyzed:
                conn.exec_driver_sql("ANALYZE celery_lease_jobs")
        with engine.connect() as conn:
            raw = conn.connection.dbapi_connection
            with raw.cursor() as cur:
                cur.execute(f"SET plan_cache_mode = {mode}")
                cur.execute(prepared.prepare_sql)
                # A durable statement's EXECUTE goes with SET LOCAL synchronous_commit in
                # front (db/durability.py); EXPLAIN takes the EXECUTE alone.
                execute = prepared.execute_sql.removeprefix(durability.SYNC_ON)
                cur.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + execute, prepared.values(params))
                (plan,) = cur.fetchone()[0]
                cur.execute("SELECT count(*) FROM celery_lease_jobs WHERE updated_at > now() - interval '1 minute'")
                (changed,) = cur.fetchone()
            raw.rollback()
    finally:
        engine.dispose()
    return (plan if isinstance(plan, dict) else json.loads(plan))["Plan"], changed


MODES = ["force_custom_plan", "force_generic_plan"]


@pytest.mark.parametrize("mode", MODES)
def test_sweep_plan_reads_the_due_rows_not_the_backlog(pg, mode):
    fills = [
        _FILL.format(run_after="NULL", woken_at="now()", rows=FRESH),
        _FILL.format(run_after="now() + interval '1 hour'", woken_at="NULL", rows=DELAYED),
    ]
    fills += [_FILL.format(run_after=run_after, woken_at=woken_at, rows=3) for run_after, woken_at in DUE.values()]
    stmt = maintenance.claim_due_wakeups("postgresql")
    root, _ = _explain(pg, mode, stmt, {"stale_seconds": 30.0, "limit": 100}, fills)
    assert root["Actual Rows"] == 3 * len(DUE), "every due job is woken, nothing else"
    scans = _scans(root)
    assert ("Seq Scan", None) not in scans, scans
    assert scans.count(("Index Scan", "celery_lease_jobs_wakeup")) == 3, scans
    # Each due row is read by its range and by the UPDATE's primary-key probe; the
    # 25,000 rows of the backlog not at all.
    assert _visited(root) <= 2 * 3 * len(DUE) + 3, json.dumps(root, indent=1)


EXPIRED, LIVE, TERMINAL = 300, 5_000, 20_000


@pytest.mark.parametrize(("mode", "analyzed"), [("force_generic_plan", False), ("force_custom_plan", True)])
def test_reap_plan_reads_one_batch_not_the_backlog(pg, mode, analyzed):
    """One reap statement: :limit of the expired leases, each read twice (its range of
    the running index, its primary-key probe), whatever else the table holds.

    Not asserted: a custom plan made with statistics that know no expired lease (an
    empty table's) takes a bitmap scan and a sort, reading every expired lease each
    statement (as every reap statement did before it was prepared). The prepared reap
    turns to its generic plan, asserted here, after its first five runs on a connection."""
    running = (
        "INSERT INTO celery_lease_jobs (id, kind, task, status, attempt, max_attempts, lease_seconds, lease_generation,"
        " lease_owner, lease_expires_at, payload, created_at, updated_at) SELECT gen_random_uuid(), 'echo',"
        " 'tests.apps.app.echo', {status}, 1, 3, 30, 1, {owner}, {expires}, '{{}}'::jsonb, now() - interval '1 hour',"
        " now() - interval '1 hour' FROM generate_series(1, {rows})"
    )
    fills = [
        running.format(status="'succeeded'", owner="NULL", expires="NULL", rows=TERMINAL),
        running.format(status="'running'", owner="'w/1/b'", expires="now() + interval '1 hour'", rows=LIVE),
        running.format(status="'running'", owner="'w/1/b'", expires="now() - interval '1 minute'", rows=EXPIRED),
    ]
    limit = 100
    root, changed = _explain(pg, mode, maintenance.reap_expired_logged(), {"limit": limit}, fills, analyzed=analyzed)
    assert root["Actual Rows"] == changed == limit
    scans = _scans(root)
    assert ("Seq Scan", None) not in scans, scans
    assert ("Index Scan", "celery_lease_jobs_running") in scans, scans
    assert _visited(root) <= 2 * limit + 3, json.dumps(root, indent=1)


def test_an_idle_reap_tick_is_one_read(pg, broker, client_app, make_job):
    """Nothing expired: the tick is the any_lease_elapsed probe alone (autocommit, no
    transaction id, no durable commit), not the reap transition's transaction (its
    mark takes a transaction id, so its commit is a WAL record and an fsync every tick)."""
    mod = client_app(pg, broker)
    make_job(pg, status="running", lease_owner="w/1/b", lease_expires_at=sa.text("now() + interval '1 hour'"))
    seen: list[str] = []

    def record(conn, cursor, statement, parameters, context, executemany):
        seen.append(statement)

    assert mod.leases.reap() == {"requeued": 0, "expired": 0}  # warm: statements prepared
    sa.event.listen(sa.engine.Engine, "before_cursor_execute", record)
    try:
        assert mod.leases.reap() == {"requeued": 0, "expired": 0}
    finally:
        sa.event.remove(sa.engine.Engine, "before_cursor_execute", record)
    assert len(seen) == 1 and seen[0].startswith("EXECUTE"), seen
