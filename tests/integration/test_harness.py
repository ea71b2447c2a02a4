"""The fault-test harness itself: a private PostgreSQL that really crashes and
recovers, and libfaketime that really skews only the wall clock of a child process.

Later fault tests rely on exactly these behaviours, so they are checked here rather
than assumed. Nothing here is skipped when a tool is missing: `bash dev.sh test`
installs both, and a silently skipped harness would hide a broken install step.
"""

from __future__ import annotations

import json
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
from tests.harness import faketime, pgcluster
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
                "SELECT current_user, rolsuper FROM pg_roles WHERE rolname = current_user"
            ).one()
            settings = dict(
                conn.exec_driver_sql(
                    "SELECT name, setting FROM pg_settings WHERE name IN "
                    "('fsync', 'synchronous_commit', 'full_page_writes', 'listen_addresses')"
                ).all()
            )
    finally:
        engine.dispose()
    assert (user, superuser) == (me, True)
    assert settings == {"fsync": "on", "synchronous_commit": "on", "full_page_writes": "on", "listen_addresses": "127.0.0.1"}
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
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True)
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


# --- faketime -------------------------------------------------------------------------

CLOCKS = textwrap.dedent("""
    import json, selectors, socket, threading, time
    from datetime import datetime, timezone
    wall, mono, aware = time.time(), time.monotonic(), datetime.now(timezone.utc).timestamp()

    def took(wait):
        start = time.monotonic()
        wait()
        return time.monotonic() - start

    lock, sel, (a, b) = threading.Lock(), selectors.DefaultSelector(), socket.socketpair()
    lock.acquire()
    sel.register(a, selectors.EVENT_READ)
    waits = {
        "sleep": took(lambda: time.sleep(0.1)),
        "event": took(lambda: threading.Event().wait(0.1)),
        "lock": took(lambda: lock.acquire(timeout=0.1)),
        "select": took(lambda: sel.select(0.1)),
    }
    print(json.dumps({"wall": wall, "mono": mono, "aware": aware, "waits": waits}))
""")


def child_clocks(env: dict) -> tuple[dict, tuple[float, float], tuple[float, float]]:
    """Run CLOCKS under ``env``; return what it saw and this process's wall and
    monotonic clocks just before and just after."""
    wall0, mono0 = time.time(), time.monotonic()
    out = subprocess.run([sys.executable, "-c", CLOCKS], env=env, capture_output=True, text=True, timeout=30)
    wall1, mono1 = time.time(), time.monotonic()
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout), (wall0, wall1), (mono0, mono1)


@pytest.mark.parametrize("offset, seconds", [("-30s", -30), ("+3600s", 3600), ("+1h", 3600), ("-6", -6)])
def test_faketime_skews_the_wall_clock_only(offset, seconds):
    assert faketime.available(), "libfaketime missing: bash dev.sh test installs it"
    seen, (wall0, wall1), (mono0, mono1) = child_clocks(faketime.skewed_env(offset))
    # The child read its clock between our two readings: shifted by the offset, it must
    # fall in that window (a second of slack for the float and the scheduler).
    for wall in (seen["wall"], seen["aware"]):
        assert wall0 - 1 <= wall - seconds <= wall1 + 1, (wall - wall0, seconds)
    # The monotonic clock is the machine's own, shared with us and unshifted.
    assert mono0 <= seen["mono"] <= mono1
    # Sleeps and timeouts keep their real length: they neither fail (time.sleep under
    # libfaketime 0.9.10, see faketime.py) nor hang for the offset.
    for name, took in seen["waits"].items():
        assert 0.09 <= took < 2, (name, took)


def test_without_faketime_the_child_clock_is_real():
    seen, (wall0, wall1), _ = child_clocks(dict(os.environ))
    assert wall0 <= seen["wall"] <= wall1
    skewed = faketime.skewed_env("+1h")
    seen, (wall0, wall1), _ = child_clocks(faketime.without_skew(skewed))
    assert wall0 <= seen["wall"] <= wall1


def test_skewed_env_keeps_the_base_env_and_other_preloads():
    base = {"PATH": "/usr/bin", "LD_PRELOAD": "/lib/other.so", "KEEP": "1"}
    env = faketime.skewed_env("-6s", base)
    assert base == {"PATH": "/usr/bin", "LD_PRELOAD": "/lib/other.so", "KEEP": "1"}
    assert env["KEEP"] == "1" and env["PATH"] == "/usr/bin"
    assert env["LD_PRELOAD"] == f"{faketime.shim_path()}:{faketime.library_path()}:/lib/other.so"
    assert env["FAKETIME"] == "-6"
    assert env["FAKETIME_DONT_FAKE_MONOTONIC"] == "1" and env["FAKETIME_NO_CACHE"] == "1"
    # Skewing twice replaces the offset instead of preloading the library twice.
    again = faketime.skewed_env("+1h", env)
    assert again["LD_PRELOAD"] == env["LD_PRELOAD"] and again["FAKETIME"] == "+3600"


@pytest.mark.parametrize(
    "offset, seconds, value",
    [
        ("-6s", -6, "-6"),
        ("+1h", 3600, "+3600"),
        ("-30", -30, "-30"),
        ("+1.5m", 90, "+90"),
        ("+2d", 172800, "+172800"),
        ("-0.25", -0.25, "-0.25"),
        (-6, -6, "-6"),
        (0, 0, "+0"),
        (3600.0, 3600, "+3600"),
    ],
)
def test_offsets(offset, seconds, value):
    assert faketime.offset_seconds(offset) == seconds
    assert faketime._faketime_value(faketime.offset_seconds(offset)) == value


@pytest.mark.parametrize("bad", ["6s", "+6w", "", "+", "-1h30m", "@2020-01-01 00:00:00"])
def test_bad_offsets_are_refused(bad):
    with pytest.raises(ValueError):
        faketime.offset_seconds(bad)
