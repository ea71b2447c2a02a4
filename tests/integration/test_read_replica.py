"""``lease_read_database_url`` (issue #29): reads that may lag go to a replica, nothing
else does.

A private primary with a streaming standby (tests/harness/pgcluster.py). The standby's
replay is paused, so what the primary commits afterwards is missing there: a read that
misses a job that the primary has was served by the replica, one that finds it was
served by the primary. Every write of the test goes through the same CeleryLease: the
standby refuses writes, so one routed there would fail.
"""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from celery import Celery

from celery_lease import CeleryLease
from celery_lease.db import migrate
from celery_lease.db.dashboard_store import DashboardStore
from celery_lease.db.statements.dashboard import Filter
from celery_lease.db.store import Store
from celery_lease.errors import ConfigurationError, DatabaseUnavailable
from celery_lease.ops import listing
from celery_lease.settings import Settings
from tests.harness import pgcluster
from tests.harness.services import free_port, wait_for
from tests.integration.test_api import ADMIN, SCRAPER, Server


@pytest.fixture(scope="module")
def pair():
    if not pgcluster.available():
        pytest.skip("needs PostgreSQL server binaries (bash dev.sh test installs them)")
    with pgcluster.replicated_pair() as (primary, standby):
        from tests.apps.app import test_metadata

        store = Store(primary.create_database("jobs"))
        migrate.upgrade(store)
        test_metadata.create_all(store.durable)
        store.dispose()
        yield primary, standby


@pytest.fixture
def paused(pair):
    """Replay paused on the standby for the test: what the primary commits from now on
    is not visible there (synchronous commit waits for the standby's flush, not its
    replay). Resumed afterwards, and the standby caught up."""
    primary, standby = pair
    engine = sa.create_engine(standby.url("jobs"), isolation_level="AUTOCOMMIT")
    # Caught up first: replay paused before the standby had replayed the module's
    # migration left it without the tables (CI run of 2026-12-03: "relation
    # celery_lease_jobs does not exist" on the replica).
    primary_engine = sa.create_engine(primary.url("jobs"), isolation_level="AUTOCOMMIT")
    with primary_engine.connect() as conn:
        lsn = conn.execute(sa.text("SELECT pg_current_wal_lsn()")).scalar_one()
    primary_engine.dispose()

    def replayed() -> bool:
        try:
            with engine.connect() as conn:
                return conn.execute(sa.text("SELECT pg_last_wal_replay_lsn() >= CAST(:lsn AS pg_lsn)"), {"lsn": lsn}).scalar_one()
        except sa.exc.OperationalError:
            # Not even the CREATE DATABASE replayed yet (a loaded run: 'database "jobs"
            # does not exist' on the standby).
            return False

    wait_for(replayed, timeout=30, interval=0.05, what="the standby to replay the primary's WAL")
    with engine.connect() as conn:
        conn.execute(sa.text("SELECT pg_wal_replay_pause()"))
    yield
    with engine.connect() as conn:
        conn.execute(sa.text("SELECT pg_wal_replay_resume()"))
    engine.dispose()


@pytest.fixture
def leases(pair):
    primary, standby = pair
    app = Celery("replica", broker="memory://")
    leases = CeleryLease(app, primary.url("jobs"), read_database_url=standby.url("jobs"))

    @leases.job(kind="replica_echo")
    def echo(ctx, payload):
        return payload

    yield leases, echo
    leases.store.dispose()


def test_lists_counts_and_metrics_read_the_replica_and_nothing_else_does(pair, leases, paused):
    leases, echo = leases
    job = echo.submit({"n": 1})  # a write: the primary (the standby would refuse it)
    store, board = leases.store, DashboardStore(leases.store)

    # Reads that may lag: the replica, which has not replayed the submit.
    assert job.id not in {j.id for j in listing.list_page(leases, listing.Query.parse()).jobs}
    assert job.id not in {r["id"] for r in listing.list_view_page(leases, listing.Query.parse()).rows}
    assert job.id not in {r["id"] for r in board.page(Filter(), after=None, scan=100, limit=50, may_lag=True)[0]}
    assert not any(c["n"] for c in board.counts(tenant=None, window=3600)["active"])
    assert not any(row[2] for row in store.metrics(30)["jobs"])

    # Reads that decide or show one job's truth, and every write: the primary.
    assert leases.get(job.id).status.value == "pending"
    assert job.id in {r["id"] for r in board.page(Filter(), after=None, scan=100, limit=50)[0]}  # a bulk action's selection
    assert board.job(job.id, tenant=None, cap=10) is not None
    assert leases.cancel(job.id) is True
    assert leases.get(job.id).status.value == "cancelled"


def test_the_api_lists_from_the_replica_and_refuses_to_start_on_a_broken_one(pair, paused, redis_server, make_job, tmp_path):
    primary, standby = pair
    server = Server(primary.url("jobs"), redis_server.url, tmp_path, conf={"lease_read_database_url": standby.url("jobs")})
    try:
        with server.client(ADMIN) as api:
            before = {j["id"] for j in api.get("/api/v1/jobs").json()["jobs"]}
            job_id = make_job(primary.url("jobs"))  # committed on the primary
            assert api.get(f"/api/v1/jobs/{job_id}").json()["status"] == "pending"  # the primary
            listed = {j["id"] for j in api.get("/api/v1/jobs").json()["jobs"]}
            assert job_id not in listed and listed == before  # the replica: not replayed yet
            assert api.get("/metrics", headers=SCRAPER).status_code == 200
            assert api.post(f"/api/v1/jobs/{job_id}/cancel").json()["cancelled"] is True  # a write: the primary
    finally:
        server.stop()

    # A read URL that does not answer: `lease serve` refuses to start, naming the setting.
    dead = f"postgresql+psycopg2://{primary.user}@127.0.0.1:{free_port()}/jobs"
    with pytest.raises(AssertionError) as exited:
        Server(primary.url("jobs"), redis_server.url, tmp_path, conf={"lease_read_database_url": dead})
    assert "lease_read_database_url" in str(exited.value)


def test_a_read_url_is_checked_at_the_boundary(pair, monkeypatch, tmp_path):
    primary, _ = pair
    with pytest.raises(ConfigurationError, match="lease_read_database_url") as refused:
        _ = CeleryLease(Celery("x", broker="memory://"), primary.url("jobs"), read_database_url="not a url pw-secret").store
    assert "pw-secret" not in str(refused.value)
    with pytest.raises(ConfigurationError, match="needs PostgreSQL"):
        _ = CeleryLease(Celery("x", broker="memory://"), f"sqlite:///{tmp_path}/j", read_database_url=primary.url("jobs")).store
    monkeypatch.setenv("CELERY_LEASE_READ_DATABASE_URL", primary.url("jobs"))
    assert Settings.resolve({}, {}).read_database_url == primary.url("jobs")
    assert Settings.resolve({"lease_read_database_url": "postgresql://conf/db"}, {}).read_database_url == "postgresql://conf/db"
    broken = Store(primary.url("jobs"), read_url=f"postgresql+psycopg2://{primary.user}@127.0.0.1:{free_port()}/jobs")
    try:
        with pytest.raises(DatabaseUnavailable, match="replica .*lease_read_database_url"):
            broken.ping_lagging()
        broken.ping()  # the primary is not affected
    finally:
        broken.dispose()
