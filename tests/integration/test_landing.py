"""A Landing (celery_lease/db/landing.py) settles a lost reply by asking the server;
across a crash of that server, the transaction's id no longer names it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa

from celery_lease.db.engine import Database
from celery_lease.db.landing import Landing
from celery_lease.db.statements import landing as landing_statements
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
        yield c


def _tags(cluster) -> list[str]:
    conn = cluster.connect("landing")
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT tag FROM t ORDER BY id")
            return [r[0] for r in cur.fetchall()]
    finally:
        conn.close()


def _crashed_before_commit(cluster) -> tuple[Landing[int], Callable[[Any], int]]:
    """A Landing whose first try inserts 'ours' and crashes the server before COMMIT
    (which then meets a dead server): its question is kept, unanswered. Returns the
    landing and its work (each try returns its number)."""
    db = Database(cluster.url("landing"))
    landing: Landing[int] = Landing(db, db.durable)
    tries: list[int] = []

    def work(conn) -> int:
        tries.append(1)
        conn.execute(sa.text("INSERT INTO t (tag) VALUES ('ours')"))
        if len(tries) == 1:
            cluster.crash()
        return len(tries)

    with pytest.raises(DatabaseUnavailable):
        landing.run(work)  # the server cannot be asked: the question is kept
    cluster.start()
    return landing, work


def test_a_transaction_a_crash_forgot_runs_again_though_its_xid_now_names_another(cluster):
    """The server crashes after our transaction took its xid and before COMMIT: its WAL
    never reached the disk, so the recovered server hands the same xid out again. Asked
    then, pg_xact_status answered for whoever took it ('committed': our work was taken
    as landed and never run again) or, before anyone did, raised "transaction ID is in
    the future" (SQLSTATE 22023, which a batched success took for a refused value and
    failed its job with: history test, seed 396076). Either way the question is void
    across a restart: the work runs again."""
    landing, work = _crashed_before_commit(cluster)
    sent = landing._sent
    assert sent is not None

    # Other transactions take xids again from where the recovered WAL ends; ours is
    # among them.
    conn = cluster.connect("landing")
    conn.autocommit = True
    taken = []
    with conn.cursor() as cur:
        for _ in range(20):
            cur.execute("BEGIN; INSERT INTO t (tag) VALUES ('other'); SELECT pg_current_xact_id()::text")
            taken.append(cur.fetchone()[0])
            cur.execute("COMMIT")
        cur.execute("SELECT pg_xact_status(%s::xid8)", (sent.xid,))
        assert cur.fetchone()[0] == "committed"
    conn.close()
    assert sent.xid in taken, "the crash did not forget the xid: the test shows nothing"

    assert landing.run(work) == 2  # run again, not taken for landed
    assert not landing.landed_earlier
    assert _tags(cluster).count("ours") == 1


def test_an_xid_in_the_future_is_not_an_error(cluster):
    """Asked about a forgotten xid before anyone took it again, the server raised
    (SQLSTATE 22023); the Landing runs the work again instead."""
    landing, work = _crashed_before_commit(cluster)
    assert landing.run(work) == 2
    assert _tags(cluster) == ["ours"]


def test_the_servers_start_is_compared_whatever_the_sessions_time_zone(cluster):
    """The mark and the question may run on sessions with other TimeZone settings (a
    role's or database's default, a pooler's); the same server is never 'restarted'."""
    db = Database(cluster.url("landing"))
    with db.durable.begin() as conn:
        conn.execute(sa.text("SET LOCAL TimeZone = 'UTC'"))
        xid, _, started = conn.execute(landing_statements.transaction_mark(False)).one()
    with db.durable.begin() as conn:
        conn.execute(sa.text("SET LOCAL TimeZone = 'Asia/Kolkata'"))
        status = conn.execute(landing_statements.transaction_status(), {"xid": xid, "started": started}).scalar()
    assert status == "committed"
    db.dispose()
