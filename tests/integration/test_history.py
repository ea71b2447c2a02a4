"""Finished jobs past the hot table (db/schema.py, "finished jobs past the hot table"):
the archive moves them and their events into day partitions, every read still finds
them, retention drops a day whole, and the migrations run while the previous release
works. SQLite keeps the one table."""

from __future__ import annotations

import datetime as dt
import threading
import uuid

import sqlalchemy as sa

from celery_lease.db import migrate
from celery_lease.db.dashboard_store import DashboardStore
from celery_lease.db.statements.dashboard import Filter
from celery_lease.db.store import Store
from celery_lease.status import Status
from tests.conftest import throwaway_database
from tests.harness.services import wait_for

CONF = {"lease_archive_after": 60}


def _scalar(url: str, sql: str, **params):
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            return conn.execute(sa.text(sql), params).scalar()
    finally:
        engine.dispose()


def _backdate(url: str, job_id: str, days: float) -> dt.date:
    """Say the job finished ``days`` ago; the UTC day it then finished on."""
    finished = _scalar(
        url,
        "UPDATE celery_lease_jobs SET finished_at = now() - make_interval(secs => :s) WHERE id = :id RETURNING finished_at",
        s=days * 86400,
        id=job_id,
    )
    return finished.astimezone(dt.timezone.utc).date()


def _where(url: str, job_id: str) -> tuple[int, int]:
    """(rows in celery_lease_jobs, rows in celery_lease_history) of the job."""
    hot = _scalar(url, "SELECT count(*) FROM celery_lease_jobs WHERE id = :id", id=job_id)
    old = _scalar(url, "SELECT count(*) FROM celery_lease_history WHERE id = :id", id=job_id)
    return hot, old


def _finished(mod, n: int, run_id: str, **options) -> list[str]:
    ids = [mod.echo.submit({"value": i}, run_id=run_id, **options).id for i in range(n)]
    for job_id in ids:
        assert mod.leases.wait(job_id, 30).status is Status.SUCCEEDED
    return ids


def test_finished_jobs_move_to_day_partitions_and_every_read_finds_them(pg, broker, client_app, workers):
    mod = client_app(pg, broker, conf=CONF)
    workers(pg, broker)
    run_id = str(uuid.uuid4())
    old, recent, today = _finished(mod, 3, run_id)
    (keyed,) = _finished(mod, 1, run_id, idempotency_key="once")
    live = mod.echo.submit({"value": 9}, run_id=run_id, run_after=3600).id
    days = {_backdate(pg, old, 3), _backdate(pg, recent, 1), _backdate(pg, keyed, 3)}
    events_before = {j: [e["event"] for e in mod.leases.run_events(run_id) if e["job_id"] == j] for j in (old, recent)}

    assert mod.leases.maintenance.archive() == 2  # today's job finished < archive_after ago

    assert _where(pg, old) == _where(pg, recent) == (0, 1)
    # A keyed job keeps its key's uniqueness in the hot table; live and fresh ones stay.
    assert _where(pg, keyed) == _where(pg, live) == _where(pg, today) == (1, 0)
    assert mod.echo.submit({"value": 1}, idempotency_key="once").id == keyed
    parts = mod.leases.store.history_partitions()
    assert days <= set(parts["celery_lease_history"]) and days <= set(parts["celery_lease_history_events"])
    assert _scalar(pg, "SELECT count(*) FROM celery_lease_events WHERE job_id IN (:a, :b)", a=old, b=recent) == 0

    # Every read: the job and its result (Celery's AsyncResult too), the API's view and
    # lists, the run's events, the dashboard's pages, the metrics.
    assert mod.leases.get(old).result == {"echo": 0, "attempt": 1}
    assert mod.app.AsyncResult(recent).get(timeout=5) == {"echo": 1, "attempt": 1}
    assert mod.leases.store.get_view(old)["status"] == "succeeded"
    listed = [j["id"] for j in mod.leases.store.list_summaries(max_value_bytes=1024, run_id=run_id, limit=10)]
    assert set(listed) == {old, recent, today, keyed, live}
    assert {j: [e["event"] for e in mod.leases.run_events(run_id) if e["job_id"] == j] for j in (old, recent)} == events_before
    board = DashboardStore(mod.leases.store)
    rows, _ = board.page(Filter(run_id=run_id), after=None, scan=100, limit=10)
    assert {r["id"] for r in rows} == {old, recent, today, keyed, live}
    assert board.job(old, tenant=None, cap=100)["result_text"] == '{"echo": 0, "attempt": 1}'
    assert [e["event"] for e in board.job_events(old, 10)] == events_before[old]
    totals = mod.leases.store.metrics(30.0)["jobs"]
    assert sum(row[2] for row in totals if row[0] == "succeeded") == 4

    # A second archive finds nothing more; the moved rows are in exactly one table.
    assert mod.leases.maintenance.archive() == 0
    assert _scalar(pg, "SELECT count(*) FROM celery_lease_jobs_all") == 5


def test_retention_drops_whole_days_and_deletes_no_row(pg, broker, client_app, workers):
    mod = client_app(pg, broker, conf=CONF)
    workers(pg, broker)
    run_id = str(uuid.uuid4())
    gone, kept = _finished(mod, 2, run_id)
    gone_day, kept_day = _backdate(pg, gone, 10), _backdate(pg, kept, 0.5)
    assert mod.leases.maintenance.archive() == 2

    # Retention 7 days: the day 10 days ago ended long since, yesterday's has not. No
    # job is deleted row by row (the count is of the hot table's), so the prune leaves
    # no dead tuple.
    assert mod.leases.prune(older_than=7 * 86400) == 0

    parts = mod.leases.store.history_partitions()
    for table in ("celery_lease_history", "celery_lease_history_events"):
        assert gone_day not in parts[table] and kept_day in parts[table]
    assert _where(pg, gone) == (0, 0) and _where(pg, kept) == (0, 1)
    assert mod.leases.get(gone) is None and mod.leases.get(kept).status is Status.SUCCEEDED
    assert [e["job_id"] for e in mod.leases.run_events(run_id)] == [kept] * 3


def test_the_dashboards_delete_and_retry_reach_archived_jobs(pg, broker, client_app, workers):
    mod = client_app(pg, broker, conf=CONF)
    workers(pg, broker)
    run_id = str(uuid.uuid4())
    job_id = mod.flaky.submit({"failure": "bad input"}, run_id=run_id).id
    assert mod.leases.wait(job_id, 30).status is Status.FAILED
    _backdate(pg, job_id, 1)
    assert mod.leases.maintenance.archive() == 1

    from celery_lease.lifecycle import transition as tr
    from celery_lease.ops.retry import retry_as_new

    new = retry_as_new(mod.leases, job_id)
    assert new is not None and mod.leases.get(new).parent_id == job_id
    rows = mod.leases.lifecycle.execute(tr.DELETE, build={"ids": [job_id], "tenant": None})
    assert [str(r["id"]) for r in rows] == [job_id]
    assert _where(pg, job_id) == (0, 0)
    assert _scalar(pg, "SELECT count(*) FROM celery_lease_history_events WHERE job_id = :id", id=job_id) == 0


def test_sqlite_keeps_every_job_in_the_one_table(sqlite_url, broker, client_app, workers):
    mod = client_app(sqlite_url, broker, conf={"lease_archive_after": 0})
    workers(sqlite_url, broker)
    job_id = mod.echo.submit({"value": 1}).id
    assert mod.leases.wait(job_id, 30).status is Status.SUCCEEDED
    assert mod.leases.maintenance.archive() == 0
    assert mod.leases.store.history_partitions() == {"celery_lease_history": [], "celery_lease_history_events": []}
    assert mod.leases.get(job_id).result == {"echo": 1, "attempt": 1}
    assert mod.leases.prune(older_than=0) == 1


#: The previous release's writes of one job, on the columns it knows (0013's): a submit,
#: a claim, a success.
_PREVIOUS_RELEASE = (
    "INSERT INTO celery_lease_jobs (id, kind, task, status, max_attempts, lease_seconds, payload, created_at,"
    " updated_at) VALUES (:id, 'previous', 'previous.task', 'pending', 1, 30, '{}', now(), now())",
    "UPDATE celery_lease_jobs SET status = 'running', attempt = 1, lease_generation = lease_generation + 1,"
    " lease_expires_at = now() + interval '30 seconds', started_at = now(), updated_at = now()"
    " WHERE id = :id AND status = 'pending'",
    "UPDATE celery_lease_jobs SET status = 'succeeded', result = '{}', lease_expires_at = NULL,"
    " finished_at = now(), updated_at = now() WHERE id = :id AND status = 'running'",
)


def test_the_migrations_run_while_the_previous_release_works(broker, client_app, workers):
    """Upgrading from 0013 to the head while the previous release's fleet submits, claims
    and finishes a stream of jobs (its statements, on the columns it knows): none of its
    writes fails, and this release's workers then run on the migrated database, the
    history at once. This release reads and writes fair_key (0015), so it is migrated
    before its workers start, and a fleet of the previous release is what runs meanwhile."""
    with throwaway_database("celery_lease_online") as url:
        store = Store(url)
        migrate.upgrade(store, "0013_kind_limits")
        from tests.apps.app import test_metadata

        test_metadata.create_all(store.durable)
        engine = sa.create_engine(url)
        finished: list[str] = []
        errors: list[str] = []
        stop = threading.Event()

        def previous_fleet():
            while not stop.is_set():
                job_id = str(uuid.uuid4())
                try:
                    for statement in _PREVIOUS_RELEASE:
                        with engine.begin() as conn:
                            assert conn.execute(sa.text(statement), {"id": job_id}).rowcount == 1
                except Exception as exc:  # the assertion below names it
                    errors.append(repr(exc))
                    return
                finished.append(job_id)
                stop.wait(0.01)

        fleet = threading.Thread(target=previous_fleet, daemon=True)
        fleet.start()
        wait_for(lambda: len(finished) >= 20 or errors, timeout=30, what="the previous release's jobs")
        assert migrate.upgrade(store) == migrate.head()
        during = len(finished)
        wait_for(lambda: len(finished) >= during + 20 or errors, timeout=30, what="its jobs after the migration")
        stop.set()
        fleet.join()
        engine.dispose()
        assert errors == []
        count = "SELECT count(*) FROM celery_lease_jobs WHERE kind = 'previous' AND status = 'succeeded'"
        assert _scalar(url, count) == len(finished)

        mod = client_app(url, broker, conf=CONF)
        workers(url, broker)
        submitted = [mod.echo.submit({"value": i}).id for i in range(20)]
        for job_id in submitted:
            assert mod.leases.wait(job_id, 60).status is Status.SUCCEEDED
        _backdate(url, submitted[0], 1)
        assert mod.leases.maintenance.archive() == 1
        assert mod.leases.get(submitted[0]).status is Status.SUCCEEDED
        store.dispose()


def test_beats_archive_moves_jobs_while_workers_finish_them(pg, broker, client_app, workers, beats):
    """Beat archiving every second, a second after jobs finish, while two workers run a
    stream of them: each job ends once, is in exactly one table at every moment a read
    looks, and keeps all its events."""
    conf = {"lease_archive_after": 1, "lease_archive_interval": 1}
    mod = client_app(pg, broker, conf=conf)
    workers(pg, broker, name="w1", conf=conf)
    workers(pg, broker, name="w2", conf=conf)
    beats(pg, broker, conf=conf)
    run_id = str(uuid.uuid4())
    ids = [mod.echo.submit({"value": i}, run_id=run_id).id for i in range(150)]
    for job_id in ids:
        assert mod.leases.wait(job_id, 60).status is Status.SUCCEEDED
        assert _scalar(pg, "SELECT count(*) FROM celery_lease_jobs_all WHERE id = :id", id=job_id) == 1
    wait_for(
        lambda: _scalar(pg, "SELECT count(*) FROM celery_lease_history WHERE run_id = :r", r=run_id) == len(ids),
        timeout=60,
        what="beat to archive every job",
    )
    assert _scalar(pg, "SELECT count(*) FROM celery_lease_jobs WHERE run_id = :r", r=run_id) == 0
    lives = [e["event"] for e in mod.leases.run_events(run_id)]
    assert lives.count("dispatched") == lives.count("claimed") == lives.count("succeeded") == len(ids)
