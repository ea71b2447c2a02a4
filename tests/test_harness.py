"""The fault-test harness itself: a private PostgreSQL that really crashes and
recovers.

Later fault tests rely on exactly these behaviours, so they are checked here rather
than assumed. Nothing here is skipped when a tool is missing: `bash dev.sh test`
installs it, and a silently skipped harness would hide a broken install step.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psycopg2
import pytest
import sqlalchemy as sa

from tests.conftest import PG_ADMIN, ROOT, wait_for
from tests.harness import pgcluster
from tests.harness.pgcluster import PrivateCluster, private_cluster


def alive(pid: int) -> bool:
    """Running and not a zombie (a zombie still answers kill(pid, 0))."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def postmaster_pid(cluster: PrivateCluster) -> int:
    return int((cluster.data_dir / "postmaster.pid").read_text().splitlines()[0])


@pytest.fixture
def cluster():
    with private_cluster() as c:
        yield c


@pytest.fixture
def db(cluster):
    engine = sa.create_engine(cluster.create_database("harness"))
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE t (id int PRIMARY KEY, note text)")
    yield engine
    engine.dispose()


def ids(engine) -> list[int]:
    with engine.connect() as conn:
        return [r[0] for r in conn.exec_driver_sql("SELECT id FROM t ORDER BY id")]


# --- PrivateCluster -------------------------------------------------------------------


def test_cluster_is_private_and_looks_like_the_shared_server(cluster):
    assert cluster.port != 5432
    me = sa.engine.make_url(PG_ADMIN).username
    assert cluster.url("x") == f"postgresql+psycopg2://{me}@127.0.0.1:{cluster.port}/x"
    engine = sa.create_engine(cluster.url())
    try:
        with engine.connect() as conn:
            user, superuser = conn.exec_driver_sql(
                "SELECT current_user, rolsuper FROM pg_roles WHERE rolname = current_user").one()
            settings = dict(conn.exec_driver_sql(
                "SELECT name, setting FROM pg_settings WHERE name IN "
                "('fsync', 'synchronous_commit', 'full_page_writes', 'listen_addresses')").all())
    finally:
        engine.dispose()
    assert (user, superuser) == (me, True)
    assert settings == {"fsync": "on", "synchronous_commit": "on", "full_page_writes": "on",
                        "listen_addresses": "127.0.0.1"}
    # The socket lives in the cluster's own directory, not /var/run/postgresql.
    assert (cluster.dir / f".s.PGSQL.{cluster.port}").exists()


def test_committed_row_survives_a_crash_and_an_uncommitted_one_does_not(cluster, db):
    with db.begin() as conn:
        conn.exec_driver_sql("INSERT INTO t VALUES (1, 'committed')")
    open_txn = db.connect()
    open_txn.begin()
    open_txn.exec_driver_sql("INSERT INTO t VALUES (2, 'in flight')")
    pid = postmaster_pid(cluster)

    cluster.crash()
    assert not cluster.is_running() and not cluster.is_ready()
    assert not alive(pid)
    with pytest.raises(sa.exc.OperationalError):
        open_txn.exec_driver_sql("SELECT 1")
    open_txn.close()

    log_before = len(cluster.log())
    cluster.start()
    recovery = cluster.log()[log_before:]
    # A real crash: no shutdown checkpoint, so the commit came back by WAL replay.
    assert "immediate shutdown request" in cluster.log()[:log_before]
    assert "not properly shut down; automatic recovery in progress" in recovery
    assert "redo starts at" in recovery
    assert ids(db) == [1]


def test_a_connection_open_across_the_crash_errors_and_a_new_one_works(cluster, db):
    held = db.connect()
    assert held.exec_driver_sql("SELECT 1").scalar() == 1
    raw = cluster.connect("harness")  # a plain psycopg2 connection as well

    cluster.crash()
    cluster.start()

    with pytest.raises(sa.exc.OperationalError):
        held.exec_driver_sql("SELECT 1")
    held.close()
    with pytest.raises(psycopg2.OperationalError):
        with raw.cursor() as cur:
            cur.execute("SELECT 1")
    raw.close()
    # SQLAlchemy saw the disconnect and emptied the pool: the same engine reconnects.
    with db.connect() as conn:
        assert conn.exec_driver_sql("SELECT 1").scalar() == 1
    fresh = sa.create_engine(cluster.url("harness"))
    with fresh.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM t").scalar() == 0
    fresh.dispose()


def test_down_means_refused_and_restart_keeps_port_and_data(cluster, db):
    with db.begin() as conn:
        conn.exec_driver_sql("INSERT INTO t VALUES (1, 'kept')")
    port, url = cluster.port, cluster.url("harness")

    cluster.crash()
    with pytest.raises(psycopg2.OperationalError):
        cluster.connect("harness", connect_timeout=2).close()
    cluster.start()
    started = time.monotonic()
    cluster.restart(downtime=0.3)  # a clean (fast) stop this time
    assert time.monotonic() - started >= 0.3
    cluster.restart(crash=True)
    assert cluster.is_ready() and (cluster.port, cluster.url("harness")) == (port, url)
    db.dispose()  # its pooled connections died with the server
    assert ids(db) == [1]


def test_the_shared_server_is_not_disturbed(cluster):
    shared = sa.create_engine(PG_ADMIN)
    try:
        with shared.connect() as before:
            backend = before.exec_driver_sql("SELECT pg_backend_pid()").scalar()
            cluster.crash()
            cluster.start()
            # The very same session on the shared server is still alive.
            assert before.exec_driver_sql("SELECT pg_backend_pid()").scalar() == backend
    finally:
        shared.dispose()


def test_close_stops_the_server_and_removes_the_directory_even_on_error():
    with pytest.raises(RuntimeError, match="test body failed"):
        with private_cluster() as c:
            pid, directory = postmaster_pid(c), c.dir
            raise RuntimeError("test body failed")
    assert not directory.exists()
    assert not alive(pid)
    c.close()  # twice is fine


def test_a_cluster_left_by_a_killed_process_is_swept_by_the_next_one():
    """pytest killed by SIGKILL (or a thread-method timeout) runs no clean-up: the next
    process that makes a cluster stops and removes the orphan."""
    script = textwrap.dedent("""
        import sys, time
        from tests.harness.pgcluster import PrivateCluster
        c = PrivateCluster().start()
        pid = open(c.data_dir / "postmaster.pid").read().split()[0]
        print(c.dir, pid, flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        line = proc.stdout.readline()
        assert line, "the child did not start a cluster"
        directory, pid = Path(line.split()[0]), int(line.split()[1])
        assert alive(pid)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert directory.exists() and alive(pid)  # an orphan, as promised

    pgcluster._swept = False  # it sweeps once per process; this process did already
    pgcluster._sweep_stale_clusters()
    assert not directory.exists()
    wait_for(lambda: not alive(pid), timeout=10, what="the orphaned postmaster to exit")
