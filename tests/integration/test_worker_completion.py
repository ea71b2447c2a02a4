"""The process's completer against real PostgreSQL (worker/completion.py): plain
successes gathered and written by one statement (end_jobs), each fenced by its own
lease generation; a value the database refuses costs no other row."""

from __future__ import annotations

import time
import uuid

import pytest
import sqlalchemy as sa

from celery_lease.db.schema import jobs
from celery_lease.db.store import Store
from celery_lease.errors import LeaseLost
from celery_lease.lifecycle import transition as tr
from celery_lease.status import AttemptOutcome
from celery_lease.worker.attempt import LAPSE_SHARE
from celery_lease.worker.completion import UNSTORABLE_RESULT, BackgroundCompleter, Item, write_endings
from tests.conftest import attempt_for, local_pipeline, wait_for
from tests.harness.tcpproxy import TcpProxy
from tests.integration.test_native_canvas import NATIVE, _left_running
from tests.integration.test_native_canvas import _rows as _job_rows


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


def test_waiting_successes_are_written_together_each_fenced_with_their_run_events(pg, make_job):
    """One statement writes the successes gathered; one whose generation a reap bumped
    is not written, and a run's history gets a 'succeeded' event for each written only."""
    store = Store(pg)
    try:
        run = str(uuid.uuid4())
        store.ensure_run(run)
        done, stale = _running(pg, make_job, run_id=run), _running(pg, make_job, generation=2, run_id=run)
        completer = BackgroundCompleter(local_pipeline(store))
        first, second = attempt_for(done), attempt_for(stale, generation=1)  # a reap took generation 2
        first.pending_write = second.pending_write = True
        _add(completer, first, {"ok": 1}, {"step": 9})
        _add(completer, second, {"ok": 2}, None)
        completer.flush()
        rows = _rows(pg)
        assert (rows[done].status, rows[done].result, rows[stale].status) == ("succeeded", {"ok": 1}, "running")
        assert rows[stale].result is None and rows[stale].lease_generation == 2
        assert not first.pending_write and not second.pending_write
        events = {(str(e["job_id"]), e["event"], e["attempt"]) for e in store.run_events(run)}
        assert events == {(done, "succeeded", 1)}
    finally:
        store.dispose()


def test_a_refused_success_does_not_cost_the_others(pg, make_job):
    """A value PostgreSQL refuses fails the shared statement: the successes are written
    row by row, and the refused one ends its job failed, never left running."""
    store = Store(pg)
    try:
        good, bad = _running(pg, make_job), _running(pg, make_job)
        completer = BackgroundCompleter(local_pipeline(store))
        completer.LINGER = 60.0  # both wait for the flush: one statement
        _add(completer, attempt_for(good), {"note": "fine"}, None)
        _add(completer, attempt_for(bad), {"note": "a\x00b"}, None)  # jsonb refuses NUL
        completer.flush()
        rows = _rows(pg)
        assert (rows[good].status, rows[good].result) == ("succeeded", {"note": "fine"})
        assert (rows[bad].status, rows[bad].error) == ("failed", UNSTORABLE_RESULT)
    finally:
        store.dispose()


def test_a_success_whose_lease_lapsed_by_its_own_clock_is_still_written_and_a_lost_one_is_not(pg, make_job):
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
        lapsed_attempt.pending_write = gone_attempt.pending_write = True
        completer = BackgroundCompleter(local_pipeline(store))
        _add(completer, lapsed_attempt, {"ok": 1}, None)
        _add(completer, gone_attempt, {"ok": 2}, None)
        completer.flush()
        rows = _rows(pg)
        assert (rows[lapsed].status, rows[lapsed].result) == ("succeeded", {"ok": 1})
        assert rows[gone].status == "running"
        assert not lapsed_attempt.pending_write and not gone_attempt.pending_write  # released, not left waiting
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
        pipeline = local_pipeline(store)

        def complete(endings):
            attempts = [attempt_for(e.job_id, 1) for e in endings]
            return {str(r["id"]) for r in pipeline.execute(tr.END, tr.ending_params(endings), attempts=attempts)}

        assert complete([_success(j, {"n": 1}) for j in first]) == set(first)
        assert complete([_success(j, [j], "p") for j in more]) == set(more)
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
            params = tr.ending_params([_success(j, None) for j in more[:3]])
            compiled = attempt_sql.end_jobs("postgresql").compile(dialect=conn.dialect)
            (custom,) = conn.exec_driver_sql("EXPLAIN (FORMAT JSON) " + compiled.string, compiled.construct_params(params)).one()
            statement = Prepared(attempt_sql.end_jobs("postgresql"))
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
        statement, info = Prepared(attempt_sql.end_jobs("postgresql")), {}
        for job in [_running(pg, make_job) for _ in range(7)]:
            statement.execute(
                raw.dbapi_connection,
                info,
                tr.ending_params([_success(job, 1)]),
            )
            raw.commit()
        with raw.cursor() as cur:
            cur.execute("SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE name = %s", (statement.name,))
            assert cur.fetchone() == (7, 0)
    finally:
        raw.close()


def _add(completer, attempt, result, progress) -> None:
    """Hand ``completer`` a plain success of ``attempt``, as the worker does."""
    completer.add(attempt, tr.Ending.succeeded(attempt, result, progress))


def _success(job_id: str, result, progress=None) -> tr.Ending:
    return tr.Ending(job_id, 1, AttemptOutcome.SUCCEEDED, result=result, progress=progress)


def _scans(node: dict) -> set[tuple[str, str]]:
    found = {(node["Node Type"], node.get("Relation Name", ""))}
    for child in node.get("Plans", ()):
        found |= _scans(child)
    return found


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
        completer = BackgroundCompleter(local_pipeline(store))
        completer.LINGER = 5.0  # one batch: flush() ends it
        for n, attempt in enumerate(attempts):
            # The third result holds NUL, which jsonb refuses (it passed no codec here).
            _add(completer, attempt, {"n": n, "note": "a\x00b" if n == 2 else "fine"}, None)
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


def test_failures_with_different_errors_share_one_statement_and_each_errback_gets_its_own(pg, broker, client_app):
    """Two failures written by one END (the completer's one algorithm): each leased
    errback is created with its own job's error, which END returns per row; the
    transition's one error for all would give both the same."""
    mod = client_app(pg, broker, module=NATIVE)
    submitted = [mod.inc.apply_async(({"n": n},), countdown=600, link_error=[mod.noted_error.s()]) for n in (1, 2)]
    for job in submitted:
        _left_running(pg, job.id, "w@host/1/boot", last_attempt=False, expires="1 hour")
    rows = _rows(pg)
    attempts = [attempt_for(job.id, generation=rows[job.id].lease_generation) for job in submitted]
    items = [Item(a, tr.Ending.failed(a, f"boom {n}")) for n, a in enumerate(attempts, 1)]
    pipeline = mod.leases.lifecycle
    ends: list[int] = []
    execute = pipeline.execute

    def counted(t, *args, **kwargs):
        ends.append(len(kwargs.get("attempts") or [kwargs.get("attempt")]))
        return execute(t, *args, **kwargs)

    pipeline.execute = counted
    try:
        write_endings(pipeline, items)
    finally:
        del pipeline.execute
    assert ends == [2]  # one statement for both
    assert [i.error for i in items] == [None, None]
    rows = _rows(pg)
    assert [(rows[j.id].status, rows[j.id].error) for j in submitted] == [("failed", "boom 1"), ("failed", "boom 2")]
    errbacks = _job_rows(pg, jobs.c.kind == "noted_error")
    got = {(str(e["parent_id"]), e["payload"]["error"]) for e in errbacks}
    assert got == {(submitted[0].id, "boom 1"), (submitted[1].id, "boom 2")}


def test_a_failure_waiting_through_an_outage_gets_lease_lost_when_its_lease_lapses(pg, make_job):
    """The database goes away while a failure waits on Completer.end: its caller gets
    LeaseLost once the lease lapses by the attempt's own clock, not when the database
    comes back (the outcome is no longer its to report). The completer keeps trying the
    fenced write, which lands once the database answers: no row is left running."""
    proxy = TcpProxy("127.0.0.1", sa.engine.make_url(pg).port or 5432).start()
    store = Store(proxy.url_for(pg))
    completer = BackgroundCompleter(local_pipeline(store))
    try:
        job = _running(pg, make_job)
        attempt = attempt_for(job, lease_seconds=2)
        store.ping()  # a connection open before the outage (it is cut)
        proxy.refuse(3600)
        proxy.cut_all()
        started = time.monotonic()
        with pytest.raises(LeaseLost):
            completer.end(attempt, tr.Ending.failed(attempt, "boom"))
        waited = time.monotonic() - started
        assert waited < attempt.lease_seconds * LAPSE_SHARE + 1.0, waited  # not until the database came back
        assert _rows(pg)[job].status == "running"  # the outage held the write back
        proxy.refuse(0)
        wait_for(lambda: _rows(pg)[job].status == "failed", timeout=30)
        assert _rows(pg)[job].error == "boom"
    finally:
        proxy.refuse(0)
        completer.flush()
        store.dispose()
        proxy.close()
