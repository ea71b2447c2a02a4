"""Liveness rules of issue #9 that need a real database but no worker: database time
for every due and staleness decision, bounded maintenance statements, idempotent
retries, the heartbeat's renewal statement.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import textwrap
import threading

import pytest
import sqlalchemy as sa

from celery_lease.db.schema import jobs
from celery_lease.lifecycle import transition as tr
from celery_lease.lifecycle.claim import claim_delivery
from tests.conftest import ROOT, SUMMARY_LINES, _env, local_pipeline
from tests.harness import faketime
from tests.harness.services import wait_for


@pytest.fixture
def db(pg):
    engine = sa.create_engine(pg)
    yield engine
    engine.dispose()


def row(db, job_id: str) -> dict:
    with db.connect() as conn:
        return dict(conn.execute(sa.select(jobs).where(jobs.c.id == job_id)).mappings().one())


def seconds_from_db_now(db, value) -> float:
    with db.connect() as conn:
        return conn.execute(sa.select(sa.func.extract("epoch", sa.literal(value) - sa.func.now()))).scalar()


# --- clocks (item 9) ------------------------------------------------------------------------


@pytest.mark.skipif(not faketime.available(), reason="needs libfaketime and a C compiler (bash dev.sh test installs them)")
def test_a_submitting_host_an_hour_fast_moves_no_due_or_wakeup_time(pg, broker, redis_server, client_app, db):
    """woken_at and a relative run_after come from the database's clock: a host an
    hour fast used to stamp woken_at an hour ahead, hiding a lost wakeup from the
    sweeper for an hour, and to push a 2 s delay an hour out."""
    script = textwrap.dedent(
        """
        import json
        from tests.apps.app import echo
        now = echo.submit({"value": "now"})
        later = echo.submit({"value": "later"}, run_after=2)
        many = echo.submit_many([{"value": 1}, {"value": 2}], run_after=2)
        print(json.dumps([now.id, later.id] + [j.id for j in many]))
        """
    )
    env = faketime.skewed_env("+1h", _env(pg, broker))
    out = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    now_id, *delayed = json.loads(out.stdout.strip().splitlines()[-1])
    assert abs(seconds_from_db_now(db, row(db, now_id)["woken_at"])) < 60
    for job_id in delayed:
        r = row(db, job_id)
        assert r["woken_at"] is None
        assert 0 < seconds_from_db_now(db, r["run_after"]) < 60

    # The wakeup of the job due now is lost; the sweeper re-sends it once stale by the
    # database's clock (2 s here), not an hour later.
    redis_server.flush()
    mod = client_app(pg, broker, conf={"lease_sweep_stale_seconds": 1})
    swept: list[str] = []

    def sweep_all() -> bool:
        swept.extend(str(r["id"]) for r in mod.leases.store.claim_due_wakeups(1, 100))
        return set(swept) >= {now_id, *delayed}

    wait_for(sweep_all, timeout=20, interval=0.25, what="the sweeper to re-send every wakeup")


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


def test_a_web_app_submitting_from_many_threads_does_not_exhaust_the_pool(pg, broker, client_app, db):
    """Submits from 40 threads at once, in a process that is not a worker: each thread
    used to pin a pooled connection for its prepared INSERT, and the 13th waited 30 s
    for one of the 12 and failed. Outside a worker the pool lends one per statement."""
    mod = client_app(pg, broker)
    errors: list[BaseException] = []
    start, done = threading.Barrier(40), threading.Barrier(40)

    def submit_five():
        # Like a web server's request threads: they live on after a request.
        start.wait()
        try:
            for i in range(5):
                mod.echo.submit({"value": i})
        except BaseException as exc:  # reported below, with its type
            errors.append(exc)
        done.wait(timeout=90)

    threads = [threading.Thread(target=submit_five) for _ in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    with db.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(jobs)).scalar() == 200


# --- lost replies (item 7) ---------------------------------------------------------------------


@pytest.fixture
def proxy(pg_proxy):
    """A TCP proxy in front of the shared PostgreSQL, that the test may freeze or cut."""
    return pg_proxy


def _jobs_with_payload(db, value: str) -> list[str]:
    with db.connect() as conn:
        return [str(r[0]) for r in conn.execute(sa.select(jobs.c.id).where(jobs.c.payload["value"].as_string() == value))]


@pytest.mark.parametrize("how", ["single", "keyed", "run"])
def test_a_submit_whose_reply_was_lost_is_retried_without_duplicate_or_error(pg, broker, client_app, db, proxy, how):
    """The INSERT (or the COMMIT of a run's submit) reaches PostgreSQL and commits, then
    the connection drops before the reply: the retry must find what landed. (It raised
    a raw UniqueViolation for a job that existed, and callers retried and duplicated.)"""
    import uuid

    mod = client_app(proxy.url_for(pg), broker)
    marker = f"lost-reply-{uuid.uuid4().hex}"
    options: dict = {}
    if how == "keyed":
        options["idempotency_key"] = marker
    if how == "run":
        options["run_id"] = str(uuid.uuid4())
        proxy.cut_reply_to(b"COMMIT")  # the run, the row and its event commit together
    else:
        proxy.cut_reply_to(marker.encode())
    job = mod.echo.submit({"value": marker}, **options)
    assert proxy.cuts == 1  # the reply really was lost
    assert _jobs_with_payload(db, marker) == [job.id]
    assert mod.leases.get(job.id).status.value == "pending"
    if how == "run":
        events = mod.leases.run_events(options["run_id"])
        assert [e["event"] for e in events] == ["dispatched"]  # logged once, by the try that landed


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
