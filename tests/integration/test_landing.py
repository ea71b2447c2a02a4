"""A Landing (celery_lease/db/landing.py) settles a lost reply by the marker row its
transaction wrote, never by the transaction's id: across a crash of the server, or of
one backend (which resets them all without a restart), the xid may name another
transaction or none."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa

from celery_lease.db import schema
from celery_lease.db.engine import Database
from celery_lease.db.landing import Landing
from celery_lease.errors import DatabaseUnavailable
from tests.harness import pgcluster


@pytest.fixture
def cluster():
    if not pgcluster.available():
        pytest.skip("needs PostgreSQL server binaries (bash dev.sh test installs them)")
    # The WAL writer waits 10 s: WAL that no commit flushed stays in memory, and a
    # crash forgets it, as it forgets the tail of a busy server's WAL.
    with pgcluster.private_cluster(settings={"wal_writer_delay": "10s"}) as c:
        c.create_database("landing")
        conn = c.connect("landing")
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute("CREATE TABLE t (id serial PRIMARY KEY, tag text NOT NULL)")
        conn.close()
        db = Database(c.url("landing"))
        schema.landings.create(db.durable)
        db.dispose()
        yield c


def _rows(cluster, sql: str) -> list:
    conn = cluster.connect("landing")
    try:
        with conn.cursor() as cur:
            cur.execute(sql)
            return [r[0] for r in cur.fetchall()]
    finally:
        conn.close()


def _tags(cluster) -> list[str]:
    return _rows(cluster, "SELECT tag FROM t ORDER BY id")


def _landing(cluster, first_try: Callable[[Any], None]) -> tuple[Landing[int], Callable[[Any], int]]:
    """A Landing and its work: each try inserts 'ours' and returns its number; the first
    one then calls ``first_try(conn)`` before its COMMIT."""
    db = Database(cluster.url("landing"))
    landing: Landing[int] = Landing(db, db.durable)
    tries: list[int] = []

    def work(conn) -> int:
        tries.append(1)
        conn.execute(sa.text("INSERT INTO t (tag) VALUES ('ours')"))
        if len(tries) == 1:
            first_try(conn)
        return len(tries)

    return landing, work


def _crashed_before_commit(cluster) -> tuple[Landing[int], Callable[[Any], int]]:
    """A Landing whose first try crashes the server before COMMIT (which then meets a
    dead server): its question is kept, unanswered."""
    landing, work = _landing(cluster, lambda conn: cluster.crash())
    with pytest.raises(DatabaseUnavailable):
        landing.run(work)  # the server cannot be asked: the question is kept
    cluster.start()
    return landing, work


def _take_xids(cluster, n: int = 20) -> list[str]:
    """Commit ``n`` other transactions; returns their xids."""
    conn = cluster.connect("landing")
    conn.autocommit = True
    taken = []
    try:
        with conn.cursor() as cur:
            for _ in range(n):
                cur.execute("BEGIN; INSERT INTO t (tag) VALUES ('other'); SELECT pg_current_xact_id()::text")
                taken.append(cur.fetchone()[0])
                cur.execute("COMMIT")
    finally:
        conn.close()
    return taken


def test_a_transaction_a_crash_forgot_runs_again_though_its_xid_now_names_another(cluster):
    """The server crashes after our transaction took its xid and before COMMIT: its WAL
    never reached the disk, so the recovered server hands the same xid out again. Asked
    then, pg_xact_status answered for whoever took it ('committed': our work was taken
    as landed and never run again) or, before anyone did, raised "transaction ID is in
    the future" (SQLSTATE 22023, which a batched success took for a refused value and
    failed its job with: history test, seed 396076). The marker row settles it: the
    work runs again."""
    landing, work = _crashed_before_commit(cluster)
    sent = landing._sent
    assert sent is not None
    # Other transactions take xids again from where the recovered WAL ends; ours is
    # among them.
    assert sent.xid in _take_xids(cluster), "the crash did not forget the xid: the test shows nothing"
    assert landing.run(work) == 2  # run again, not taken for landed
    assert not landing.landed_earlier
    assert _tags(cluster).count("ours") == 1


def test_an_xid_in_the_future_is_not_an_error(cluster):
    """Asked about a forgotten xid before anyone took it again, the server raised
    (SQLSTATE 22023); the Landing runs the work again instead."""
    landing, work = _crashed_before_commit(cluster)
    assert landing.run(work) == 2
    assert _tags(cluster) == ["ours"]


def _backend_killed_before_commit(cluster, *, reuse: bool) -> tuple[Landing[int], Callable[[Any], int], list[str]]:
    """A Landing whose first try's server process is SIGKILLed after its work and before
    its COMMIT is flushed (the OOM killer, a segfault): the postmaster resets every
    backend and replays the WAL, without a restart. With ``reuse``, other clients take
    xids before the Landing asks (ours among them). Returns the landing, its work and
    the xids taken (ours first)."""
    xids: list[str] = []

    def kill(conn) -> None:
        xids.append(conn.execute(sa.text("SELECT pg_current_xact_id()::text")).scalar())
        cluster.kill_backend(conn.execute(sa.text("SELECT pg_backend_pid()")).scalar())
        if reuse:
            xids.extend(_take_xids(cluster))

    landing, work = _landing(cluster, kill)
    return landing, work, xids


def test_a_transaction_a_backend_crash_forgot_runs_again_though_its_xid_now_names_another(cluster):
    """One backend killed: no restart, so pg_postmaster_start_time() did not change and
    the old Landing trusted pg_xact_status, which answered 'committed' for the
    transaction that took our forgotten xid: the work was taken as landed, never run,
    and its caller ran the follow-ups of a transition that never happened."""
    landing, work, xids = _backend_killed_before_commit(cluster, reuse=True)
    assert landing.run(work) == 2  # run again, not taken for landed
    assert xids[0] in xids[1:], "the crash did not forget the xid: the test shows nothing"
    assert not landing.landed_earlier
    assert _tags(cluster).count("ours") == 1


def test_an_xid_a_backend_crash_forgot_is_not_an_error(cluster):
    """Asked before anyone took the forgotten xid, the server raised "transaction ID is
    in the future" (SQLSTATE 22023), which escaped the old Landing as a DataError."""
    landing, work, _ = _backend_killed_before_commit(cluster, reuse=False)
    assert landing.run(work) == 2
    assert _tags(cluster) == ["ours"]


def test_a_commit_whose_reply_was_lost_is_found_by_its_marker(cluster):
    """The other way round: a transaction that committed is found committed by its
    marker (its work is not run again), also after a backend crash since; a token no
    transaction wrote is found not committed."""
    landing, work = _landing(cluster, lambda conn: None)
    assert landing.run(work) == 1
    (token,) = _rows(cluster, "SELECT token::text FROM celery_lease_landings")
    victim = cluster.connect("landing")
    with victim.cursor() as cur:
        cur.execute("SELECT pg_backend_pid()")
        cluster.kill_backend(cur.fetchone()[0])
    assert landing._ask(token) is True
    assert landing._ask("00000000-0000-4000-8000-000000000000") is False
    assert _tags(cluster) == ["ours"]
