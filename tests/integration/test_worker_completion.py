"""The worker's completions against real PostgreSQL (worker/completion.py): batched
successes riding on the process's next claim (db.statements.claim.claim with riding=True),
one statement that claims the next job and writes the waiting successes, each still fenced
by its own lease generation; and a refused batch written row by row."""

from __future__ import annotations

import time
import uuid

import sqlalchemy as sa

from celery_lease.db.schema import jobs
from celery_lease.db.store import Store
from celery_lease.lifecycle.claim import claim_delivery
from celery_lease.worker.attempt import Attempt
from celery_lease.worker.completion import UNSTORABLE_RESULT, BatchCompleter
from tests.conftest import attempt_for, local_pipeline

TASK = "tests.apps.app.echo"


def _running(pg, make_job, generation: int = 1, **columns) -> str:
    return make_job(
        pg,
        status="running",
        attempt=1,
        lease_generation=generation,
        lease_owner="w@host/1/boot",
        lease_expires_at=sa.text("now() + interval '1 hour'"),
        **columns,
    )


def _rows(pg) -> dict[str, sa.Row]:
    engine = sa.create_engine(pg)
    try:
        with engine.connect() as conn:
            query = sa.select(jobs.c.id, jobs.c.status, jobs.c.result, jobs.c.error, jobs.c.lease_generation)
            return {str(r.id): r for r in conn.execute(query)}
    finally:
        engine.dispose()


def test_a_claim_writes_the_waiting_successes_each_fenced(pg, make_job):
    store = Store(pg)
    try:
        done, stale = _running(pg, make_job), _running(pg, make_job, generation=2)
        pending = make_job(pg)
        completer = BatchCompleter(store, local_pipeline(store))
        completer.LINGER = 60.0  # the thread never writes them: only the claim can
        completer.add(attempt_for(done), {"ok": 1}, {"step": 9})
        completer.add(attempt_for(stale, generation=1), {"ok": 2}, None)  # a reap took generation 2
        riding = completer.take()
        assert riding is not None and len(riding.attempts) == 2
        row = claim_delivery(store, pending, "w@host/1/boot", TASK, successes=riding)
        completer.settle(riding)

        assert row is not None and str(row["id"]) == pending and row["lease_generation"] == 1
        assert riding.done == {done}
        rows = _rows(pg)
        assert (rows[pending].status, rows[done].status, rows[stale].status) == ("running", "succeeded", "running")
        assert rows[done].result == {"ok": 1} and rows[stale].result is None and rows[stale].lease_generation == 2
        assert completer.take() is None  # nothing left waiting, nothing given back
    finally:
        store.dispose()


def test_the_successes_ride_even_when_nothing_is_claimed(pg, make_job):
    store = Store(pg)
    try:
        done = _running(pg, make_job)
        duplicate = _running(pg, make_job)  # its delivery is a duplicate: running already
        completer = BatchCompleter(store, local_pipeline(store))
        completer.LINGER = 60.0
        completer.add(attempt_for(done), {"ok": 1}, None)
        riding = completer.take()
        assert riding is not None
        assert claim_delivery(store, duplicate, "w@host/1/boot", TASK, successes=riding) is None
        completer.settle(riding)
        assert riding.done == {done}
        assert _rows(pg)[done].status == "succeeded"
    finally:
        store.dispose()


def test_a_riding_claim_appends_the_run_events_of_the_successes_it_carries(pg, make_job):
    """The riding claim writes a run's 'succeeded' event for each success it completes,
    in its own statement (one insert with the claimed job's 'claimed'); a success its
    fence refused logs nothing. Without it a carried success of a run left its run's
    history without the job's end."""

    store = Store(pg)
    try:
        run = str(uuid.uuid4())
        store.ensure_run(run)
        done = _running(pg, make_job, run_id=run)
        stale = _running(pg, make_job, generation=2, run_id=run)
        pending = make_job(pg, run_id=run)
        completer = BatchCompleter(store, local_pipeline(store))
        completer.LINGER = 60.0
        completer.add(attempt_for(done), {"ok": 1}, None)
        completer.add(attempt_for(stale, generation=1), {"ok": 2}, None)
        riding = completer.take()
        assert riding is not None
        row = claim_delivery(store, pending, "w@host/1/boot", TASK, successes=riding)
        completer.settle(riding)
        assert row is not None and riding.done == {done}
        events = {(str(e["job_id"]), e["event"], e["attempt"]) for e in store.run_events(run)}
        assert events == {(done, "succeeded", 1), (pending, "claimed", 1)}
    finally:
        store.dispose()


def test_a_refused_success_does_not_cost_the_claim(pg, make_job):
    """A value PostgreSQL refuses fails the shared statement: the claim is sent alone,
    and the successes go back to the completer, which writes them row by row."""
    store = Store(pg)
    try:
        good, bad = _running(pg, make_job), _running(pg, make_job)
        pending = make_job(pg)
        completer = BatchCompleter(store, local_pipeline(store))
        completer.LINGER = 60.0
        completer.add(attempt_for(good), {"note": "fine"}, None)
        completer.add(attempt_for(bad), {"note": "a\x00b"}, None)  # jsonb refuses NUL
        riding = completer.take()
        assert riding is not None
        row = claim_delivery(store, pending, "w@host/1/boot", TASK, successes=riding)
        assert row is not None and str(row["id"]) == pending
        assert riding.done is None
        assert [r.status for r in map(_rows(pg).get, (good, bad))] == ["running", "running"]

        completer.settle(riding)  # given back: waiting again
        completer.flush()
        rows = _rows(pg)
        assert (rows[good].status, rows[good].result) == ("succeeded", {"note": "fine"})
        assert (rows[bad].status, rows[bad].error) == ("failed", UNSTORABLE_RESULT)
    finally:
        store.dispose()


def test_a_success_whose_lease_lapsed_by_its_own_clock_still_rides_and_a_lost_one_does_not(pg, make_job):
    """Past LAPSE_SHARE of its lease with no renewal confirmed (the database was away),
    a finished body's success is still written, fenced: dropped, its row stayed running
    under this process until the reaper spent the attempt, and a retried claim of that
    process took the finished job for its own and ran it again (issue #27, item 4). A
    lease known gone (a renewal or fenced write matched no row) is not written."""
    store = Store(pg)
    try:
        lapsed, gone = _running(pg, make_job), _running(pg, make_job)
        lapsed_attempt, gone_attempt = attempt_for(lapsed), attempt_for(gone)
        lapsed_attempt.renewed_at = time.monotonic() - lapsed_attempt.lease_seconds
        assert lapsed_attempt.is_lost  # by its own clock
        gone_attempt.mark_lost()
        written: list[Attempt] = []
        completer = BatchCompleter(store, local_pipeline(store), on_written=written.append)
        completer.LINGER = 60.0
        completer.add(lapsed_attempt, {"ok": 1}, None)
        completer.add(gone_attempt, {"ok": 2}, None)
        riding = completer.take()
        assert written == [gone_attempt]  # released, not left waiting
        assert riding is not None and [item[0] for item in riding.items] == [lapsed_attempt]
        assert claim_delivery(store, make_job(pg), "w@host/1/boot", TASK, successes=riding) is not None
        completer.settle(riding)
        rows = _rows(pg)
        assert (rows[lapsed].status, rows[lapsed].result) == ("succeeded", {"ok": 1})
        assert rows[gone].status == "running"
    finally:
        store.dispose()


def test_many_successes_are_one_statement_planned_by_the_primary_key(pg, make_job):
    """A statement of many attempts binds one array per column: ONE statement (prepared
    once) for any number of rows, where there was one per row count; and its rows are
    found through the primary key, in a custom plan and in a generic one. (One JSON array
    through jsonb_to_recordset is planned as 100 rows: a hot table of a few MiB was then
    read whole by a hash join.)"""
    from celery_lease.db.prepared import Prepared
    from celery_lease.db.statements import attempt as attempt_sql

    store = Store(pg)
    try:
        first = [_running(pg, make_job)]
        more = [_running(pg, make_job) for _ in range(5)]
        prepared_before = len(store._prepared or {})
        assert store.complete_many([{"id": j, "generation": 1, "result": {"n": 1}, "progress": None} for j in first]) == set(
            first
        )
        assert store.complete_many([{"id": j, "generation": 1, "result": [j], "progress": "p"} for j in more]) == set(more)
        assert len(store._prepared or {}) == prepared_before + 1
        rows = _rows(pg)
        assert rows[first[0]].result == {"n": 1} and all(rows[j].status == "succeeded" and rows[j].result == [j] for j in more)
    finally:
        store.engine().dispose()

    engine = sa.create_engine(pg)
    try:
        with engine.begin() as conn:
            # A hot table of 20,000 running jobs, copies of one.
            conn.execute(
                sa.text(
                    "INSERT INTO celery_lease_jobs SELECT (jsonb_populate_record(NULL::celery_lease_jobs,"
                    " to_jsonb(j) || jsonb_build_object('id', gen_random_uuid()))).*"
                    " FROM celery_lease_jobs j, generate_series(1, 20000) WHERE j.id = :id"
                ),
                {"id": _running(pg, make_job)},
            )
            conn.execute(sa.text("ANALYZE celery_lease_jobs"))
            params = attempt_sql.attempt_params([{"id": j, "generation": 1, "result": None, "progress": None} for j in more[:3]])
            compiled = attempt_sql.complete_jobs().compile(dialect=conn.dialect)
            (custom,) = conn.exec_driver_sql("EXPLAIN (FORMAT JSON) " + compiled.string, compiled.construct_params(params)).one()
            statement = Prepared(attempt_sql.complete_jobs())
            conn.exec_driver_sql(statement.prepare_sql)
            conn.exec_driver_sql("SET LOCAL plan_cache_mode = force_generic_plan")
            placeholders = ", ".join(["%s"] * len(statement.values(params)))
            explain = f"EXPLAIN (FORMAT JSON) EXECUTE {statement.name} ({placeholders})"
            (generic,) = conn.exec_driver_sql(explain, tuple(statement.values(params))).one()
            conn.exec_driver_sql(f"DEALLOCATE {statement.name}")
            conn.rollback()
    finally:
        engine.dispose()
    for plan in (custom, generic):
        scans = _scans(plan[0]["Plan"])
        assert ("Index Scan", "celery_lease_jobs") in scans and ("Seq Scan", "celery_lease_jobs") not in scans, scans

    # Planned once: left to choose, PostgreSQL found the generic plan (10 rows) dearer
    # than a custom one for a row or two and planned every EXECUTE again (~1 ms each).
    raw = sa.create_engine(pg).raw_connection()
    try:
        statement, info = Prepared(attempt_sql.complete_jobs()), {}
        for job in [_running(pg, make_job) for _ in range(7)]:
            statement.execute(
                raw.dbapi_connection,
                info,
                attempt_sql.attempt_params([{"id": job, "generation": 1, "result": 1, "progress": None}]),
            )
            raw.commit()
        with raw.cursor() as cur:
            cur.execute("SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE name = %s", (statement.name,))
            assert cur.fetchone() == (7, 0)
    finally:
        raw.close()


def _scans(node: dict) -> set[tuple[str, str]]:
    found = {(node["Node Type"], node.get("Relation Name", ""))}
    for child in node.get("Plans", ()):
        found |= _scans(child)
    return found


# --- a refused batch of successes is written row by row ---------------------------------


def test_a_refused_batch_of_successes_is_retried_row_by_row(pg, make_job):
    """Before: one value PostgreSQL refuses dropped the whole batch (every job left
    running, although Celery had reported each one's success)."""
    store = Store(pg)
    try:
        ids = [
            make_job(pg, status="running", attempt=1, lease_generation=1, lease_expires_at=sa.text("now() + interval '1 hour'"))
            for _ in range(4)
        ]
        attempts = [attempt_for(i) for i in ids]
        completer = BatchCompleter(store, local_pipeline(store))
        completer.LINGER = 5.0  # one batch: flush() ends it
        for n, attempt in enumerate(attempts):
            # The third result holds NUL, which jsonb refuses (it passed no codec here).
            completer.add(attempt, {"n": n, "note": "a\x00b" if n == 2 else "fine"}, None)
        completer.flush()
        engine = sa.create_engine(pg)
        with engine.connect() as conn:
            rows = {str(r.id): r for r in conn.execute(sa.select(jobs.c.id, jobs.c.status, jobs.c.result, jobs.c.error))}
        engine.dispose()
        assert [rows[i].status for i in ids] == ["succeeded", "succeeded", "failed", "succeeded"]
        assert [rows[i].result for i in ids] == [
            {"n": 0, "note": "fine"},
            {"n": 1, "note": "fine"},
            None,
            {"n": 3, "note": "fine"},
        ]
        assert rows[ids[2]].error == UNSTORABLE_RESULT
    finally:
        store.dispose()
