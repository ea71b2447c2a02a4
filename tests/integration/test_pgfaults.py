"""tests/harness/pgfaults.py against a real PostgreSQL (a private cluster): each fault
does what it says in both protocols, and touches only the statement it matches."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from tests.harness import pgcluster
from tests.harness.pgfaults import PgFaultProxy

psycopg2 = pytest.importorskip("psycopg2")


@pytest.fixture(scope="module")
def cluster():
    if not pgcluster.available():
        pytest.skip("needs PostgreSQL server binaries (bash dev.sh test installs them)")
    with pgcluster.private_cluster() as c:
        c.create_database("faults")
        conn = c.connect("faults")
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute("CREATE TABLE t (id int PRIMARY KEY, v int NOT NULL)")
        conn.close()
        yield c


@pytest.fixture
def proxy(cluster):
    direct = cluster.connect("faults")
    direct.autocommit = True
    with direct.cursor() as cur:
        cur.execute("TRUNCATE t; INSERT INTO t VALUES (1, 0), (2, 0)")
    direct.close()
    p = PgFaultProxy(cluster.host, cluster.port).start()
    yield p
    p.close()


def through(proxy: PgFaultProxy, cluster, *, autocommit: bool = False):
    conn = psycopg2.connect(host="127.0.0.1", port=proxy.port, user=cluster.user, dbname="faults", connect_timeout=5)
    conn.autocommit = autocommit
    return conn


def value(cluster, row: int = 1) -> int:
    conn = cluster.connect("faults")
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT v FROM t WHERE id = %s", (row,))
            return cur.fetchone()[0]
    finally:
        conn.close()


def test_url_for_points_at_the_proxy(proxy, cluster):
    url = proxy.url_for(cluster.url("faults"))
    assert f":{proxy.port}/faults" in url


def test_the_proxy_forwards_without_nagle_delay(proxy, cluster):
    """Both sides of a proxied connection have TCP_NODELAY, as PostgreSQL's and libpq's
    own sockets do: the proxy sends a reply's protocol messages one by one, and with
    Nagle on, each after the first waited for the client's delayed ACK (a query and its
    commit took 132 ms through the proxy, 0.2 ms without it), so every test through it
    ran its workers some hundred times slower than a real network would."""
    conn = through(proxy, cluster)
    with conn.cursor() as cur:
        cur.execute("SELECT 1")
    # Read while the connection is open: once the client closes, the proxy closes both.
    sockets = list(proxy._sockets)
    assert len(sockets) == 2
    assert all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in sockets)
    conn.close()


def test_fail_drops_the_connection_before_the_server_sees_the_statement(proxy, cluster):
    rule = proxy.fail("SET v = v + 1")
    conn = through(proxy, cluster, autocommit=True)
    with conn.cursor() as cur:
        cur.execute("SELECT 1")  # unmatched statements pass
        with pytest.raises(psycopg2.OperationalError):
            cur.execute("UPDATE t SET v = v + 1 WHERE id = 1")
    assert rule.hits == 1 and value(cluster) == 0
    # Spent: the next connection's same statement goes through.
    conn = through(proxy, cluster, autocommit=True)
    with conn.cursor() as cur:
        cur.execute("UPDATE t SET v = v + 1 WHERE id = 1")
    conn.close()
    assert value(cluster) == 1 and [e.fault for e in proxy.events] == ["fail"]


def test_fail_with_an_error_keeps_the_connection(proxy, cluster):
    proxy.fail("SET v = v + 1", error="40001")
    conn = through(proxy, cluster)
    with conn.cursor() as cur:
        cur.execute("UPDATE t SET v = 10 WHERE id = 2")
        with pytest.raises(psycopg2.errors.SerializationFailure):
            cur.execute("UPDATE t SET v = v + 1 WHERE id = 1")
    conn.rollback()  # the whole transaction is gone, the server agrees
    with conn.cursor() as cur:
        cur.execute("UPDATE t SET v = v + 1 WHERE id = 1")
    conn.commit()
    conn.close()
    assert value(cluster, 1) == 1 and value(cluster, 2) == 0


def test_a_failed_commit_drops_the_connection_even_with_an_error(proxy, cluster):
    # An ErrorResponse made up for COMMIT would leave the server's transaction open while
    # psycopg2 deems it over (it sends no ROLLBACK after a failed COMMIT): the connection's
    # next COMMIT would commit it. A real server ends a transaction whose COMMIT failed.
    proxy.fail("COMMIT", error="57014")
    conn = through(proxy, cluster)
    with conn.cursor() as cur:
        cur.execute("UPDATE t SET v = 10 WHERE id = 2")
    with pytest.raises(psycopg2.OperationalError):
        conn.commit()
    if not conn.closed:  # as a pool would: its client deems the connection idle
        with conn.cursor() as cur:
            cur.execute("UPDATE t SET v = v + 1 WHERE id = 1")
        conn.commit()
    assert value(cluster, 2) == 0


def test_lost_reply_in_autocommit_commits(proxy, cluster):
    rule = proxy.lose_reply("SET v = v + 1")
    conn = through(proxy, cluster, autocommit=True)
    with conn.cursor() as cur, pytest.raises(psycopg2.OperationalError):
        cur.execute("UPDATE t SET v = v + 1 WHERE id = 1")
    assert rule.hits == 1 and value(cluster) == 1


def test_lost_reply_in_a_transaction_loses_the_commits_answer(proxy, cluster):
    rule = proxy.lose_reply("SET v = v + 1")
    conn = through(proxy, cluster)
    with conn.cursor() as cur:
        cur.execute("UPDATE t SET v = v + 1 WHERE id = 1")  # answered: the transaction is open
        cur.execute("UPDATE t SET v = 7 WHERE id = 2")
        assert rule.hits == 0
    with pytest.raises(psycopg2.OperationalError):
        conn.commit()
    assert rule.hits == 1 and (value(cluster, 1), value(cluster, 2)) == (1, 7)


def test_a_rollback_disarms_a_lost_reply(proxy, cluster):
    rule = proxy.lose_reply("SET v = v + 1")
    conn = through(proxy, cluster)
    with conn.cursor() as cur:
        cur.execute("UPDATE t SET v = v + 1 WHERE id = 1")
    conn.rollback()
    assert rule.hits == 0 and rule.live()
    with conn.cursor() as cur:  # the rule waits for the next match, on the same connection
        cur.execute("UPDATE t SET v = v + 1 WHERE id = 1")
    with pytest.raises(psycopg2.OperationalError):
        conn.commit()
    assert rule.hits == 1 and value(cluster) == 1


@pytest.mark.parametrize("by", ["sql", "name"])
def test_prepared_statements_match_by_text_or_name(proxy, cluster, by):
    rule = proxy.lose_reply("SET v = v + $1" if by == "sql" else "bump_it")
    conn = through(proxy, cluster, autocommit=True)
    with conn.cursor() as cur:
        # Typed as the product types them (db/prepared.py): parentheses inside the list.
        cur.execute("PREPARE bump_it (INTEGER, VARCHAR(255)) AS UPDATE t SET v = v + $1 WHERE id = 1 AND $2 IS NOT NULL")
        assert rule.hits == 0  # preparing runs nothing
        with pytest.raises(psycopg2.OperationalError):
            cur.execute("EXECUTE bump_it (%s, %s)", (5, "x"))
    assert rule.hits == 1 and value(cluster) == 5
    assert "EXECUTE bump_it" in proxy.events[0].statement


def test_delay_holds_the_statement_back(proxy, cluster):
    proxy.delay("SET v = 3", 1.0)
    conn = through(proxy, cluster, autocommit=True)
    started = time.monotonic()
    with conn.cursor() as cur:
        cur.execute("UPDATE t SET v = 3 WHERE id = 1")
    assert time.monotonic() - started >= 1.0
    conn.close()
    assert value(cluster) == 3


def test_hold_keeps_the_transaction_and_its_row_locks_open(proxy, cluster):
    rule = proxy.hold("SET v = 4", 1.5)
    conn = through(proxy, cluster)
    done = threading.Event()

    def holder():
        with conn.cursor() as cur:
            cur.execute("UPDATE t SET v = 4 WHERE id = 1")
        conn.commit()  # reaches the server 1.5 s after the UPDATE ran
        done.set()

    threading.Thread(target=holder, daemon=True).start()
    assert rule.wait(10)
    other = cluster.connect("faults")
    started = time.monotonic()
    with other.cursor() as cur:
        cur.execute("UPDATE t SET v = v + 1 WHERE id = 1")  # waits on the held row lock
    other.commit()
    waited = time.monotonic() - started
    other.close()
    assert done.wait(10)
    assert waited >= 1.0 and value(cluster) == 5


def test_cut_all_drops_open_connections_and_accepts_new_ones(proxy, cluster):
    conn = through(proxy, cluster, autocommit=True)
    assert proxy.cut_all() >= 2
    with conn.cursor() as cur, pytest.raises(psycopg2.OperationalError):
        cur.execute("SELECT 1")
    conn = through(proxy, cluster, autocommit=True)
    with conn.cursor() as cur:
        cur.execute("SELECT 1")
        assert cur.fetchone() == (1,)


# --- the extended protocol (Parse / Bind / Execute by name / Sync), spoken by hand ----


class Wire:
    """A minimal extended-protocol client (trust authentication only)."""

    def __init__(self, port: int, user: str) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        params = b"user\x00" + user.encode() + b"\x00database\x00faults\x00\x00"
        self.sock.sendall(struct.pack("!ii", len(params) + 8, 196608) + params)
        self.until_ready()

    def msg(self, kind: bytes, body: bytes) -> bytes:
        return kind + struct.pack("!i", len(body) + 4) + body

    def recv(self) -> tuple[bytes, bytes]:
        head = self._exact(5)
        return head[:1], self._exact(struct.unpack("!i", head[1:])[0] - 4)

    def _exact(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            data = self.sock.recv(n - len(out))
            if not data:
                raise ConnectionError("closed")
            out += data
        return out

    def until_ready(self) -> list[bytes]:
        kinds = []
        while True:
            kind, body = self.recv()
            kinds.append(kind)
            if kind == b"E":
                raise RuntimeError(body)
            if kind == b"Z":
                return kinds

    def prepare(self, name: str, sql: str) -> None:
        self.sock.sendall(self.msg(b"P", name.encode() + b"\x00" + sql.encode() + b"\x00\x00\x00") + self.msg(b"S", b""))
        self.until_ready()

    def execute(self, name: str) -> list[bytes]:
        bind = b"\x00" + name.encode() + b"\x00" + struct.pack("!hhh", 0, 0, 0)
        self.sock.sendall(self.msg(b"B", bind) + self.msg(b"E", b"\x00" + struct.pack("!i", 0)) + self.msg(b"S", b""))
        return self.until_ready()


def test_extended_protocol_statements_are_tracked_by_name(proxy, cluster):
    wire = Wire(proxy.port, cluster.user)
    wire.prepare("s_bump", "UPDATE t SET v = v + 1 WHERE id = 2")
    wire.prepare("s_read", "SELECT v FROM t WHERE id = 2")
    rule = proxy.lose_reply("SET v = v + 1")
    assert b"D" in wire.execute("s_read")  # not matched: answered
    with pytest.raises(ConnectionError):
        wire.execute("s_bump")  # committed at its Sync, the answer lost
    assert rule.hits == 1 and value(cluster, 2) == 1

    wire = Wire(proxy.port, cluster.user)
    wire.prepare("s_bump", "UPDATE t SET v = v + 1 WHERE id = 2")
    proxy.fail("s_bump")
    with pytest.raises(ConnectionError):
        wire.execute("s_bump")
    assert value(cluster, 2) == 1
