"""The job lifecycle against real PostgreSQL, Redis and `celery worker` processes."""

from __future__ import annotations

import re

import pytest
import sqlalchemy as sa

from celery_lease import Status
from celery_lease.db.schema import events, jobs, runs
from tests.conftest import wait_for


def test_submit_runs_once_and_stores_result(pg, broker, client_app, workers):
    mod = client_app(pg, broker)
    workers(pg, broker)
    job = mod.echo.submit({"value": 7})
    assert job.status is Status.PENDING and job.attempt == 0
    done = mod.leases.wait(job.id, timeout=20)
    assert done.status is Status.SUCCEEDED
    assert done.result == {"echo": 7, "attempt": 1}
    assert done.attempt == 1 and done.lease_owner is None and done.finished_at is not None


def test_delay_and_apply_async_go_through_submit(pg, broker, client_app, workers):
    mod = client_app(pg, broker)
    workers(pg, broker)
    a = mod.echo.delay({"value": 1})
    b = mod.echo.apply_async(({"value": 2},))
    assert mod.leases.get(a.id).kind == "echo"
    assert mod.leases.wait(a.id, 20).result["echo"] == 1
    assert mod.leases.wait(b.id, 20).result["echo"] == 2


def test_duplicate_delivery_runs_the_body_once(pg, broker, client_app, workers, marker_dir):
    mod = client_app(pg, broker)
    job = mod.echo.submit({"value": 1, "marker_dir": str(marker_dir)})
    # Two more wakeups with the same task id: a redelivered or duplicated message.
    for _ in range(2):
        mod.app.send_task(job.task, task_id=job.id)
    w = workers(pg, broker)
    assert mod.leases.wait(job.id, 20).status is Status.SUCCEEDED
    wait_for(lambda: w.log().count(f"job {job.id}: duplicate or not claimable") >= 2, what="both duplicates consumed")
    runs_of_body = (marker_dir / f"echo-{job.id}").read_text().split()
    assert len(runs_of_body) == 1
    assert mod.leases.get(job.id).attempt == 1


def test_wakeup_for_unknown_job_is_acknowledged(pg, broker, client_app, workers):
    mod = client_app(pg, broker)
    w = workers(pg, broker)
    ghost = "00000000-0000-4000-8000-000000000000"
    mod.app.send_task("tests.apps.app.echo", task_id=ghost)
    real = mod.echo.submit({"value": 3})
    assert mod.leases.wait(real.id, 20).status is Status.SUCCEEDED
    wait_for(lambda: ghost in w.log(), what="the ghost wakeup to be logged")
    assert "not claimable" in w.log()
    with sa.create_engine(pg).connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(jobs)).scalar() == 1


def test_failure_is_stored_capped_without_retry(pg, broker, client_app, workers):
    mod = client_app(pg, broker)
    workers(pg, broker)
    long_message = "é" * 400  # 800 bytes; the cap is 512 bytes on a UTF-8 boundary
    job = mod.flaky.submit({"failure": long_message})
    done = mod.leases.wait(job.id, 20)
    assert done.status is Status.FAILED and done.attempt == 1
    assert done.error == "é" * 256
    assert len(done.error.encode()) == 512


def _finish(mod, *jobs):
    def finished():
        mod.leases.sweep()  # beat's sweeper delivers the retry once its backoff is due
        now = [mod.leases.get(j.id) for j in jobs]
        return now if all(j.terminal for j in now) else None

    return wait_for(finished, timeout=40, interval=0.2, what="retries to finish")


def _secret_in_no_table(pg: str, secret: str) -> None:
    with sa.create_engine(pg).connect() as conn:
        for table in (jobs, runs, events):
            for row in conn.execute(sa.select(table)):
                assert secret not in repr(tuple(row)), table.name


def test_exceptions_retry_then_fail_as_internal_error_without_leaking(pg, broker, client_app, workers):
    mod = client_app(pg, broker, conf={"lease_sweep_interval": 0.5})
    secret = "s3cr3t-Tok3n-42"
    w = workers(pg, broker, extra_env={"CL_TEST_SECRET": secret})
    job = mod.flaky.submit({}, run_id="11111111-1111-4111-8111-111111111111")
    timing_out = mod.flaky.submit({"raise": "timeout"})

    done, timed_out = _finish(mod, job, timing_out)
    assert done.status is Status.FAILED and done.attempt == 3
    # The stored error names the exception's type and a reference, never its text.
    found = re.fullmatch(r"internal error: ConnectionError \(ref ([0-9a-f]{8})\)", done.error)
    assert found, done.error
    assert re.fullmatch(r"internal error: TimeoutError \(ref [0-9a-f]{8}\)", timed_out.error), timed_out.error
    # The secret is in the worker log (with the job id and the reference, beside the
    # traceback) and in no column of any table.
    log = w.log()
    assert secret in log and job.id in log
    logged = re.search(rf"job {job.id} \(flaky\) attempt 3 raised \(ref {found[1]}\)\nTraceback", log)
    assert logged, "the reference is not logged with the traceback"
    _secret_in_no_table(pg, secret)
    with sa.create_engine(pg).connect() as conn:
        rows = conn.execute(sa.select(events.c.event, events.c.detail).where(events.c.job_id == job.id).order_by(events.c.id))
        ended = [(r.event, r.detail) for r in rows if r.event not in ("dispatched", "claimed")]
    assert [e for e, _ in ended] == ["retried", "retried", "failed"]
    assert [(a["attempt"], a["outcome"]) for a in done.attempts] == [(1, "retried"), (2, "retried"), (3, "failed")]
    # Each retry's event says which exception ended its attempt.
    assert all(d.startswith("internal error: ConnectionError (ref ") for _, d in ended), ended


def test_error_detail_opt_in_stores_the_text_redacted(pg, broker, client_app, workers):
    mod = client_app(pg, broker, conf={"lease_sweep_interval": 0.5})
    secret = "s3cr3t-Tok3n-43"
    workers(pg, broker, conf={"lease_error_detail": True}, extra_env={"CL_TEST_SECRET": secret})
    (done,) = _finish(mod, mod.flaky.submit({"raise": "value"}))
    assert done.status is Status.FAILED
    assert re.fullmatch(r"internal error: ValueError: could not connect: password=\*\*\* \(ref [0-9a-f]{8}\)", done.error), (
        done.error
    )
    _secret_in_no_table(pg, secret)


def test_retry_succeeds_on_a_later_attempt(pg, broker, client_app, workers):
    mod = client_app(pg, broker)
    workers(pg, broker)
    job = mod.flaky.submit({"ok_at": 2})

    def finished():
        mod.leases.sweep()
        j = mod.leases.get(job.id)
        return j if j.terminal else None

    done = wait_for(finished, timeout=30, interval=0.2, what="the retry")
    assert done.status is Status.SUCCEEDED and done.result == {"ok_at": 2}


def test_cancel_pending_job_at_once(pg, broker, client_app):
    mod = client_app(pg, broker)
    job = mod.echo.submit({"value": 1})
    assert mod.leases.cancel(job.id) is True
    assert mod.leases.get(job.id).status is Status.CANCELLED
    assert mod.leases.cancel(job.id) is False  # terminal: never changes again


def test_idempotency_key_returns_the_same_job(pg, broker, client_app):
    mod = client_app(pg, broker)
    a = mod.echo.submit({"value": 1}, idempotency_key="nightly-2026-11-30")
    b = mod.echo.submit({"value": 2}, idempotency_key="nightly-2026-11-30")
    assert a.id == b.id and b.payload == {"value": 1}
    with sa.create_engine(pg).connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(jobs)).scalar() == 1


def test_job_runs_on_sqlite_too(sqlite_url, broker, client_app, workers):
    mod = client_app(sqlite_url, broker)
    workers(sqlite_url, broker)
    job = mod.echo.submit({"value": "lite"})
    assert mod.leases.wait(job.id, 20).result == {"echo": "lite", "attempt": 1}


@pytest.mark.parametrize("db", ["pg", "sqlite_url"])
def test_keyset_pages_cover_every_job_once(db, request, make_job):
    """Many jobs share a created_at (same millisecond); pages must neither repeat nor
    skip them. On SQLite times are text, so the stored and the bound spelling of one
    instant must compare equal."""
    from celery_lease.db.store import Store

    url = request.getfixturevalue(db)
    made = {make_job(url) for _ in range(25)}
    store = Store(url)
    seen, after = [], None
    for _ in range(20):  # 7 pages are enough; a cursor that repeats rows must not loop forever
        page = store.list_jobs(limit=4, after=after)
        if not page:
            break
        seen.extend(j.id for j in page)
        after = (page[-1].created_at, page[-1].id)
    store.dispose()
    assert len(seen) == len(set(seen)) == 25 and set(seen) == made


def test_children_placed_in_another_run_respect_that_run(pg, broker, client_app, workers):
    """A child submitted into a cancelled run is not created (as a submit would be
    refused); one submitted into a new run creates that run."""
    import uuid

    from celery_lease.db.schema import runs

    mod = client_app(pg, broker)
    cancelled_run, new_run = str(uuid.uuid4()), str(uuid.uuid4())
    mod.leases.cancel_run(cancelled_run)
    workers(pg, broker)
    refused = mod.parent.submit({"children": [1, 2], "child_run": cancelled_run})
    placed = mod.parent.submit({"children": [3], "child_run": new_run})
    assert mod.leases.wait(refused.id, 20).status is Status.SUCCEEDED
    assert mod.leases.wait(placed.id, 20).status is Status.SUCCEEDED
    engine = sa.create_engine(pg)
    with engine.connect() as conn:
        kids = conn.execute(sa.select(jobs.c.parent_id, jobs.c.run_id).where(jobs.c.parent_id.is_not(None))).all()
        run_ids = {str(r[0]) for r in conn.execute(sa.select(runs.c.id))}
    engine.dispose()
    assert [(str(p), str(r)) for p, r in kids] == [(placed.id, new_run)]
    assert new_run in run_ids
