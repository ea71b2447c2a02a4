"""Liveness of the lifecycle that needs a real database but no worker (issue #9): bounded
maintenance statements, the heartbeat's renewal statement, a claim racing cancel_run,
a wakeup delivered during warm shutdown, the reaper (the submit side is in test_submit.py).
"""

from __future__ import annotations

import statistics
import threading

import pytest
import sqlalchemy as sa

from celery_lease.db.schema import jobs
from celery_lease.lifecycle import transition as tr
from celery_lease.lifecycle.claim import claim_delivery
from tests.conftest import SUMMARY_LINES, local_pipeline, row

# --- mass expiry (item 8) -------------------------------------------------------------------

MASS = 100_000
BATCH = 500

#: One backlog per maintenance statement: rows it must work through, inserted in bulk.
#: (status, attempt, lease_generation, lease_owner, lease_expires_at, run_after, woken_at, finished_at)
_MASS_ROWS = {
    "reap": "'running', 1, 1, 'gone@host/1/boot', now() - interval '1 hour' + g * interval '1 ms', NULL, NULL, NULL",
    "sweep": "'pending', 0, 0, NULL, NULL, NULL, NULL, NULL",
    "prune": "'succeeded', 1, 1, NULL, NULL, NULL, NULL, now() - interval '30 days' + g * interval '1 ms'",
}


def _insert_mass(db, kind: str) -> None:
    with db.begin() as conn:
        # Statistics from before the mass expiry (an empty table): what made the planner
        # rescan the old batch subquery once per row.
        conn.exec_driver_sql("ANALYZE celery_lease_jobs")
        conn.exec_driver_sql(
            "INSERT INTO celery_lease_jobs (id, kind, task, status, attempt, lease_generation, lease_owner,"
            " lease_expires_at, run_after, woken_at, finished_at, max_attempts, lease_seconds, lease_losses,"
            " payload, created_at, updated_at) "
            f"SELECT gen_random_uuid(), 'echo', 'tests.apps.app.echo', {_MASS_ROWS[kind]}, 3, 30, 0, '{{}}'::jsonb,"
            f" now(), now() FROM generate_series(1, {MASS}) g"
        )


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["reap", "sweep", "prune"])
def test_mass_backlog_is_worked_off_in_bounded_statements_at_linear_cost(pg, client_app, db, kind, request):
    """100,000 expired leases (due wakeups, old terminal jobs): each statement touches
    at most batch_size rows, and the time per statement does not grow with the
    backlog. (The ``IN (... LIMIT ... FOR UPDATE SKIP LOCKED)`` subquery was rescanned
    per row: one statement took every row, in time quadratic in them.)"""
    import time

    mod = client_app(pg, "memory://")
    store = mod.leases.store
    lifecycle = local_pipeline(store)
    _insert_mass(db, kind)
    statement = {
        "reap": lambda: len(lifecycle.execute(tr.REAP, {"limit": BATCH})),
        "sweep": lambda: len(store.claim_due_wakeups(30, BATCH)),
        "prune": lambda: store.prune(7 * 86400, BATCH),
    }[kind]
    per_statement: list[tuple[int, float]] = []
    total = 0
    while total < MASS:
        started = time.perf_counter()
        n = statement()
        per_statement.append((n, time.perf_counter() - started))
        assert 0 < n <= BATCH, (kind, n, total)
        total += n
    assert total == MASS and statement() == 0
    elapsed = sum(t for _, t in per_statement)
    first = statistics.median(t for _, t in per_statement[:20])
    last = statistics.median(t for _, t in per_statement[-20:])
    line = (
        f"mass {kind}: {MASS} rows in {len(per_statement)} statements of <= {BATCH}: {MASS / elapsed:,.0f} rows/s; "
        f"median statement {first * 1000:.1f} ms with {MASS} left, {last * 1000:.1f} ms with < {20 * BATCH} left"
    )
    request.config.stash.setdefault(SUMMARY_LINES, []).append(line)
    print(line)


# --- the heartbeat's renewal (item 3) ----------------------------------------------------------


def test_renewal_skips_a_row_locked_by_a_success_transaction_without_losing_it(pg, client_app, db, make_job):
    """A success transaction running a slow effect holds its row lock: the renewal of
    the process's leases must neither wait for it (it used to, while every other lease
    lapsed) nor report that lease lost."""
    from datetime import datetime, timedelta, timezone

    soon = datetime.now(timezone.utc) + timedelta(seconds=3)
    busy, other = (
        make_job(pg, status="running", attempt=1, lease_generation=1, lease_owner="w/1/b", lease_expires_at=soon)
        for _ in range(2)
    )
    store = client_app(pg, "memory://").leases.store
    result: dict = {}
    with db.connect() as locker:
        tx = locker.begin()
        locker.execute(sa.update(jobs).where(jobs.c.id == busy).values(progress={"effect": "running"}))
        renewal = threading.Thread(target=lambda: result.update(store.renew([(busy, 1), (other, 1), (other, 0)])))
        renewal.start()
        renewal.join(30)
        waited = renewal.is_alive()
        tx.rollback()  # a renewal that waited on the lock returns now
        renewal.join(30)
    assert not waited, "the renewal waited on the row lock"
    assert result == {(busy, 1): False, (other, 1): True}
    assert row(db, other)["lease_expires_at"] > soon + timedelta(seconds=20)  # renewed to now + 30 s
    assert row(db, busy)["lease_expires_at"] == soon  # not renewed this round, not lost either


# --- cancel_run racing new jobs (item 10) -------------------------------------------------------


def test_a_claim_racing_an_uncommitted_cancel_run_waits_and_cancels_the_job(pg, broker, client_app, db):
    """cancel_run(R) has marked the run cancelled but not committed yet, and missed a
    job of R (committed after it looked, e.g. a child of a parent's success): a claim
    of that job waits for the cancel and then cancels the job instead of starting it.
    (It started it: the run's jobs were all cancelled, but this one ran.)"""
    import uuid

    from celery_lease.db.statements import cancel

    mod = client_app(pg, broker)
    run_id = str(uuid.uuid4())
    job = mod.echo.submit({"value": 1}, run_id=run_id)
    store = mod.leases.store
    result: dict = {}
    with db.connect() as canceller:
        tx = canceller.begin()
        canceller.execute(cancel.cancel_run(), {"run_id": run_id})  # what cancel_run does first
        claim = threading.Thread(target=lambda: result.update(row=claim_delivery(store, job.id, "w@host/1/boot", job.task)))
        claim.start()
        claim.join(2)
        waited = claim.is_alive()
        tx.commit()
        claim.join(30)
    assert waited, "the claim did not wait for the cancel in progress"
    assert result["row"]["status"] == "cancelled"
    after = row(db, job.id)
    assert (after["status"], after["attempt"], after["lease_owner"]) == ("cancelled", 0, None)
    assert after["finished_at"] is not None and after["started_at"] is None
    assert [(e["event"], e["detail"]) for e in mod.leases.run_events(run_id)][-1] == ("cancelled", "run cancelled")


# --- a wakeup delivered during warm shutdown (items 9, 11) ---------------------------------------


def test_a_wakeup_delivered_during_warm_shutdown_is_republished_to_the_jobs_own_queue(pg, broker, redis_server, client_app):
    """A delivery that reaches a handler slot after warm shutdown began is spent (acked
    early): the job stays pending and is woken again at once, on its own queue (the
    row's), not on the delivery's routing key. (It went to the routing key: with a
    queue bound under another key, to a queue nobody consumes.)"""
    import redis

    from celery_lease.worker import shutdown

    mod = client_app(pg, broker)
    r = redis.Redis(port=redis_server.port)
    job = mod.echo.submit({"value": 1}, queue="special")
    running = mod.echo.submit({"value": 2})
    claim_delivery(mod.leases.store, running.id, "elsewhere/1/boot", running.task)  # not pending: nothing to re-wake
    redis_server.flush()  # their wakeups were delivered (and spent)
    shutdown.request()
    try:
        assert mod.leases.worker.begin(job.id, mod.echo.spec, "w@host") is None
        assert mod.leases.worker.begin(running.id, mod.echo.spec, "w@host") is None
    finally:
        shutdown.reset()
    assert r.llen("special") == 1 and r.llen("special.key") == 0 and r.llen("celery") == 0
    assert mod.leases.get(job.id).status.value == "pending" and mod.leases.get(job.id).attempt == 0


def test_the_reaper_expires_a_lease_with_no_attempt_left(pg, broker, client_app, db, make_job):
    """The reaper's other branch: an elapsed lease on the last attempt ends the job
    ``expired`` with error "lease expired", counted as a lease loss and logged."""
    import uuid
    from datetime import datetime, timedelta, timezone

    from celery_lease.db.schema import runs

    mod = client_app(pg, broker)
    run_id = str(uuid.uuid4())
    with db.begin() as conn:
        conn.execute(runs.insert().values(id=run_id, created_at=sa.func.now()))
    gone = datetime.now(timezone.utc) - timedelta(seconds=5)
    spent = make_job(
        pg,
        status="running",
        attempt=3,
        max_attempts=3,
        lease_generation=4,
        lease_owner="gone/1/b",
        lease_expires_at=gone,
        run_id=run_id,
    )
    retry = make_job(
        pg,
        status="running",
        attempt=1,
        max_attempts=3,
        lease_generation=1,
        lease_owner="gone/1/b",
        lease_expires_at=gone,
        run_id=run_id,
    )
    assert mod.leases.reap() == {"requeued": 1, "expired": 1}
    r = row(db, spent)
    assert (r["status"], r["error"], r["lease_losses"], r["lease_generation"]) == ("expired", "lease expired", 1, 5)
    assert r["lease_owner"] is None and r["lease_expires_at"] is None and r["finished_at"] is not None
    assert row(db, retry)["status"] == "pending"
    events = {(e["job_id"], e["event"], e["detail"]) for e in mod.leases.run_events(run_id)}
    assert (spent, "reaped", "lease expired: expired") in {(str(j), e, d) for j, e, d in events}
