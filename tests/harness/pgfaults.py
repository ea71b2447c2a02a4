"""A PostgreSQL-wire-protocol proxy that makes one chosen statement misbehave.

Workers connect through the proxy's URL; the test, in its own process, says which
statement goes wrong and how, at run time:

    proxy = PgFaultProxy("127.0.0.1", 5432).start()
    url = proxy.url_for(db_url)                     # hand this to the workers
    rule = proxy.fail("FOR UPDATE SKIP LOCKED")      # never reaches the server: the
                                                     # connection drops (error="40001":
                                                     # an ErrorResponse instead)
    rule = proxy.lose_reply("SET status")           # runs and commits; the client never
                                                     # hears back and the connection drops
                                                     # (then_pause=True: and the proxy pauses)
    rule = proxy.delay("lease_expires_at", 3.0)     # reaches the server 3 s late
    rule = proxy.hold("SET status", 3.0)            # runs, then its transaction stays open
                                                     # 3 s: whoever needs its rows waits
    rule = proxy.lose_reply("SET status", then=primary.crash)  # the server dies after
                                                     # the commit, before the client
                                                     # learns its connection dropped
    rule.wait(timeout=20)                           # it acted (rule.hits counts)
    proxy.events                                    # what acted, when, on which statement

A rule matches a statement when ``match`` occurs (case-insensitively) in its SQL or
equals its prepared-statement name; it acts ``times`` times (``None``: every time) and
is then spent. The first live rule that matches acts, in the order they were added.

Statements are tracked per connection in both protocols: the simple one (``PREPARE
name AS ...`` then ``EXECUTE name(...)``, what psycopg2 and the product's
``lease_prepare_statements`` send) and the extended one (Parse, Bind, Execute by
name, Sync). An ``EXECUTE`` matches by its prepared text.

"Lost reply" means the change is durable and the client cannot know: a statement run
in autocommit (the connection was idle) loses its own reply; one inside a transaction
arms the connection, and the reply to the transaction's COMMIT is the one lost (a
ROLLBACK disarms it, and the rule waits for another match). The proxy forwards the
request, swallows the server's whole answer up to its ReadyForQuery, then drops both
sockets: the server has committed before the client's connection breaks.

``fail`` acts before the statement is sent: by default the connection drops (what a
network failure looks like); ``error=SQLSTATE`` answers a simple-protocol query with an
ErrorResponse instead, the connection stays usable. A failed COMMIT, and ``fail`` in the
extended protocol, always drop the connection (``_statement`` says why for COMMIT).

Threads only, no dependencies beyond tests/harness/tcpproxy.py; ``pause``,
``cut_all`` and ``cut_reply_to`` of TcpProxy work too (cut_reply_to on raw bytes).
"""

from __future__ import annotations

import re
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tests.harness.tcpproxy import TcpProxy, _drop

FAIL, LOSE_REPLY, DELAY, HOLD = "fail", "lose_reply", "delay", "hold"
_COMMIT = re.compile(r"\s*(COMMIT|END)\b", re.IGNORECASE)

#: Startup-phase request codes (untyped messages).
_SSL_REQUEST, _GSSENC_REQUEST, _CANCEL_REQUEST = 80877103, 80877104, 80877102

# PREPARE name [(types, which may have their own parentheses: VARCHAR(255))] AS statement
_PREPARE = re.compile(r"^\s*PREPARE\s+(\w+)\s*(?:\((?:[^()]|\([^()]*\))*\))?\s*AS\s+(.*)$", re.IGNORECASE | re.DOTALL)
_EXECUTE = re.compile(r"\bEXECUTE\s+(\w+)", re.IGNORECASE)
_DEALLOCATE = re.compile(r"^\s*DEALLOCATE\s+(?:PREPARE\s+)?(\w+)", re.IGNORECASE)
_COMMIT = re.compile(r"^\s*(COMMIT|END)\b", re.IGNORECASE)
_ROLLBACK = re.compile(r"^\s*(ROLLBACK|ABORT)\b", re.IGNORECASE)
_BEGIN = re.compile(r"^\s*(BEGIN|START\s+TRANSACTION)\b", re.IGNORECASE)


@dataclass
class Rule:
    fault: str
    match: str
    times: int | None = 1
    seconds: float = 0.0
    error: str | None = None
    #: lose_reply: called (in the proxy's thread) once the reply is swallowed and before
    #: the connection drops, so it happens before the client can react to the loss.
    then: Callable[[], None] | None = None
    #: lose_reply: the proxy pauses (a partition) right after the reply is lost.
    then_pause: bool = False
    #: How many times it acted (for lose_reply: replies really lost, after the commit).
    hits: int = 0
    #: lose_reply matches waiting for their transaction's COMMIT.
    pending: int = 0
    fired: threading.Event = field(default_factory=threading.Event, repr=False)

    def live(self) -> bool:
        return self.times is None or self.hits + self.pending < self.times

    def matches(self, name: str, text: str) -> bool:
        needle = self.match.lower()
        return name.lower() == needle or needle in text.lower()

    def wait(self, timeout: float = 30.0) -> bool:
        """Block until the rule has acted once; whether it did."""
        return self.fired.wait(timeout)


@dataclass(frozen=True)
class Event:
    at: float  # time.time()
    connection: int
    fault: str
    match: str
    statement: str  # the first 200 characters of what matched


class _Conn:
    """One client connection's protocol state, shared by its two pump threads."""

    def __init__(self, number: int, client: socket.socket, upstream: socket.socket) -> None:
        self.number = number
        self.client, self.upstream = client, upstream
        self.statements: dict[str, str] = {}  # prepared name -> SQL ("" = unnamed)
        self.portals: dict[str, str] = {}  # portal -> statement name
        self.txstatus = "I"  # from the last ReadyForQuery: I(dle), T(ransaction), E(rror)
        self.syncs_sent = 0  # Query and Sync messages forwarded: each earns one ReadyForQuery
        self.ready_received = 0
        self.raw = False  # TLS or GSS encryption negotiated: bytes pass through unparsed
        # The client side forwarded a startup-phase message; expect_raw_byte says whether
        # its answer is one unframed byte (SSLRequest, GSSENCRequest).
        self.startup_sent = threading.Event()
        self.expect_raw_byte = False
        self.lose_at: tuple[int, Rule, str] | None = None  # drop the answer to sync number n
        self.lose_at_commit: tuple[Rule, str] | None = None
        self.lose_at_sync: tuple[Rule, str] | None = None  # extended protocol, autocommit
        self.hold_until = 0.0
        self.closed = False


class PgFaultProxy(TcpProxy):
    def __init__(self, host: str, port: int) -> None:
        super().__init__(host, port)
        self._rules: list[Rule] = []
        self._rules_lock = threading.Lock()
        self._numbers = iter(range(1, 1 << 62))
        #: Every fault that acted, in order.
        self.events: list[Event] = []
        #: Set to a list to record every statement text the proxy sees (for a test that
        #: wants to know what to match).
        self.seen: list[str] | None = None

    # --- rules ------------------------------------------------------------------------

    def fail(self, match: str, *, times: int | None = 1, error: str | None = None) -> Rule:
        return self._add(Rule(FAIL, match, times, error=error))

    def lose_reply(
        self, match: str, *, times: int | None = 1, then: Callable[[], None] | None = None, then_pause: bool = False
    ) -> Rule:
        """``then``: called once the reply is swallowed, before the connection drops.
        ``then_pause``: the proxy pauses the moment the reply is lost (``resume()`` ends
        it), so the client cannot ask the server what became of its commit."""
        return self._add(Rule(LOSE_REPLY, match, times, then=then, then_pause=then_pause))

    def delay(self, match: str, seconds: float, *, times: int | None = 1) -> Rule:
        return self._add(Rule(DELAY, match, times, seconds=seconds))

    def hold(self, match: str, seconds: float, *, times: int | None = 1) -> Rule:
        return self._add(Rule(HOLD, match, times, seconds=seconds))

    def remove(self, rule: Rule) -> None:
        with self._rules_lock:
            if rule in self._rules:
                self._rules.remove(rule)

    def clear(self) -> None:
        with self._rules_lock:
            self._rules.clear()

    def _add(self, rule: Rule) -> Rule:
        if rule.fault in (DELAY, HOLD) and rule.seconds <= 0:
            raise ValueError(f"{rule.fault} needs seconds > 0")
        if not rule.match:
            raise ValueError("a rule needs a non-empty match")
        with self._rules_lock:
            self._rules.append(rule)
        return rule

    def _claim_rule(self, name: str, text: str) -> Rule | None:
        """The first live rule matching the statement, its use counted (under the lock,
        so two connections never spend one use twice)."""
        with self._rules_lock:
            for rule in self._rules:
                if rule.live() and rule.matches(name, text):
                    if rule.fault == LOSE_REPLY:
                        rule.pending += 1
                    else:
                        rule.hits += 1
                    return rule
        return None

    def _record(self, conn: _Conn, rule: Rule, text: str) -> None:
        self.events.append(Event(time.time(), conn.number, rule.fault, rule.match, text[:200]))
        rule.fired.set()

    # --- forwarding -------------------------------------------------------------------

    def _serve(self, client: socket.socket, upstream: socket.socket) -> None:
        conn = _Conn(next(self._numbers), client, upstream)
        threading.Thread(target=self._client_side, args=(conn,), daemon=True).start()
        threading.Thread(target=self._server_side, args=(conn,), daemon=True).start()

    def _end(self, conn: _Conn) -> None:
        conn.closed = True
        conn.startup_sent.set()  # a server side still waiting for the startup gives up
        for s in (conn.client, conn.upstream):
            _drop(s)
            self._sockets.discard(s)
        with self._rules_lock:
            # A lose_reply armed on a connection that broke before its commit answered
            # lost nothing: its use is given back.
            for armed in (conn.lose_at and conn.lose_at[1], conn.lose_at_commit, conn.lose_at_sync):
                rule = armed[0] if isinstance(armed, tuple) else armed
                if isinstance(rule, Rule):
                    rule.pending -= 1
            conn.lose_at = conn.lose_at_commit = conn.lose_at_sync = None

    def _client_side(self, conn: _Conn) -> None:
        reader = _Reader(conn.client)
        try:
            # Startup phase: untyped messages until the StartupMessage.
            while True:
                body = reader.untyped()
                code = struct.unpack("!i", body[:4])[0] if len(body) >= 4 else 0
                conn.expect_raw_byte = code in (_SSL_REQUEST, _GSSENC_REQUEST)
                conn.startup_sent.set()
                if conn.expect_raw_byte:
                    self._send(conn, conn.upstream, struct.pack("!i", len(body) + 4) + body)
                    # The client speaks again only after the server's one-byte answer,
                    # which the server side has classified by then.
                    if not reader.wait_readable():
                        return
                    if conn.raw:
                        return self._raw(conn, conn.client, conn.upstream, reader.drain())
                    continue
                self._send(conn, conn.upstream, struct.pack("!i", len(body) + 4) + body)
                if code == _CANCEL_REQUEST:
                    return
                break
            while True:
                kind, body = reader.typed()
                self._from_client(conn, kind, body)
        except (OSError, EOFError):
            pass
        finally:
            self._end(conn)

    def _server_side(self, conn: _Conn) -> None:
        reader = _Reader(conn.upstream)
        try:
            # Startup phase: nothing comes before the client's first message, and the
            # answer to an encryption request is one unframed byte.
            while True:
                conn.startup_sent.wait()
                conn.startup_sent.clear()
                if conn.closed:
                    return
                if not conn.expect_raw_byte:
                    break
                byte = reader.exact(1)
                conn.raw = byte in (b"S", b"G")
                self._send(conn, conn.client, byte)
                if conn.raw:
                    return self._raw(conn, conn.upstream, conn.client, reader.drain())
            while True:
                kind, body = reader.typed()
                lose = conn.lose_at
                if lose is not None and conn.ready_received >= lose[0] - 1:
                    # Part of the answer to the request whose reply is lost: swallow it;
                    # at its ReadyForQuery the server is done (committed): drop everything.
                    if kind == b"Z":
                        rule = lose[1]
                        with self._rules_lock:
                            conn.lose_at = None
                            rule.pending -= 1
                            rule.hits += 1
                        if rule.then is not None:
                            rule.then()
                        if rule.then_pause:
                            self.pause()
                        self._record(conn, rule, lose[2])
                        return
                    continue
                if kind == b"Z":
                    conn.ready_received += 1
                    conn.txstatus = body[:1].decode()
                self._send(conn, conn.client, kind + struct.pack("!i", len(body) + 4) + body)
        except (OSError, EOFError):
            pass
        finally:
            self._end(conn)

    def _from_client(self, conn: _Conn, kind: bytes, body: bytes) -> None:
        wire = kind + struct.pack("!i", len(body) + 4) + body
        if conn.hold_until:
            # The previous statement's transaction stays open (its row locks held).
            time.sleep(max(0.0, conn.hold_until - time.monotonic()))
            conn.hold_until = 0.0
        if kind == b"Q":
            text = _cstring(body, 0)[0]
            self._seen(text)
            names, rest = self._track_simple(conn, text)
            matched = "\n".join([rest, *(conn.statements.get(n, "") for n in names)])
            return self._statement(conn, wire, " ".join(names), matched, sync=True)
        if kind == b"P":
            name, at = _cstring(body, 0)
            conn.statements[name] = _cstring(body, at)[0]
            self._seen(conn.statements[name])
        elif kind == b"B":
            portal, at = _cstring(body, 0)
            conn.portals[portal] = _cstring(body, at)[0]
        elif kind == b"E":
            name = conn.portals.get(_cstring(body, 0)[0], "")
            return self._statement(conn, wire, name, conn.statements.get(name, ""), sync=False)
        elif kind == b"S":
            if conn.lose_at_sync is not None:
                rule, text = conn.lose_at_sync
                conn.lose_at_sync = None
                conn.lose_at = (conn.syncs_sent + 1, rule, text)
            conn.syncs_sent += 1
        self._send(conn, conn.upstream, wire)

    def _statement(self, conn: _Conn, wire: bytes, name: str, text: str, *, sync: bool) -> None:
        """Forward one statement (a Query, or an Execute), acting on the rule it matches."""
        rule = self._claim_rule(name, text)
        if rule is None:
            self._commit_point(conn, text, sync)
            self._send(conn, conn.upstream, wire)
            if sync:
                conn.syncs_sent += 1
            return
        if rule.fault == FAIL:
            self._record(conn, rule, text)
            # A server that answers COMMIT with an error has ended the transaction, and
            # psycopg2 takes it so (it sends no ROLLBACK after a failed COMMIT). An answer
            # made up here would leave the server's transaction open on a connection the
            # client deems idle, for the next transaction's COMMIT to commit: a failed
            # COMMIT always drops the connection.
            if rule.error and sync and not _COMMIT.match(text):
                status = b"E" if conn.txstatus in ("T", "E") else b"I"
                self._send(conn, conn.client, _error_response(rule.error) + b"Z" + struct.pack("!i", 5) + status)
                return
            raise EOFError  # the client side ends: both sockets drop
        if rule.fault == DELAY:
            self._record(conn, rule, text)
            time.sleep(rule.seconds)
        elif rule.fault == HOLD:
            self._record(conn, rule, text)
            conn.hold_until = time.monotonic() + rule.seconds
        elif rule.fault == LOSE_REPLY:
            if conn.lose_at_commit is not None or conn.lose_at is not None or conn.lose_at_sync is not None:
                with self._rules_lock:
                    rule.pending -= 1  # this transaction's answer is already to be lost
            elif _COMMIT.match(text) or (conn.txstatus == "I" and not _BEGIN.match(text)):
                # Autocommit (or the COMMIT itself): this statement's own answer is lost.
                if sync:
                    conn.lose_at = (conn.syncs_sent + 1, rule, text)
                else:
                    conn.lose_at_sync = (rule, text)
            else:
                conn.lose_at_commit = (rule, text)
        if rule.fault != LOSE_REPLY:
            self._commit_point(conn, text, sync)
        self._send(conn, conn.upstream, wire)
        if sync:
            conn.syncs_sent += 1

    def _commit_point(self, conn: _Conn, text: str, sync: bool) -> None:
        """A COMMIT (or ROLLBACK) ends the transaction an armed lose_reply waits on."""
        if conn.lose_at_commit is None:
            return
        rule, armed_by = conn.lose_at_commit
        if _COMMIT.match(text):
            conn.lose_at_commit = None
            if sync:
                conn.lose_at = (conn.syncs_sent + 1, rule, armed_by)
            else:
                conn.lose_at_sync = (rule, armed_by)
        elif _ROLLBACK.match(text):
            conn.lose_at_commit = None
            with self._rules_lock:
                rule.pending -= 1  # nothing committed: the rule waits for another match

    def _track_simple(self, conn: _Conn, text: str) -> tuple[list[str], str]:
        """Remember PREPAREd texts; return the names this query EXECUTEs and its text
        without the PREPAREs (preparing runs nothing, so it matches nothing)."""
        rest = []
        for part in text.split(";"):
            prepared = _PREPARE.match(part)
            if prepared:
                conn.statements[prepared.group(1)] = prepared.group(2)
                continue
            gone = _DEALLOCATE.match(part)
            if gone:
                conn.statements.pop(gone.group(1), None)
            rest.append(part)
        return _EXECUTE.findall(text), ";".join(rest)

    def _seen(self, text: str) -> None:
        if self.seen is not None:
            self.seen.append(text)

    def _send(self, conn: _Conn, sink: socket.socket, data: bytes) -> None:
        self._open.wait()  # pause() holds every direction
        if self._closed or conn.closed:
            raise EOFError
        sink.sendall(data)

    def _raw(self, conn: _Conn, source: socket.socket, sink: socket.socket, pending: bytes) -> None:
        if pending:
            self._send(conn, sink, pending)
        while True:
            data = source.recv(65536)
            if not data:
                return
            self._send(conn, sink, data)


class _Reader:
    """Whole protocol messages from a socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()

    def exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            data = self.sock.recv(65536)
            if not data:
                raise EOFError
            self.buf += data
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def untyped(self) -> bytes:
        (length,) = struct.unpack("!i", self.exact(4))
        return self.exact(length - 4)

    def typed(self) -> tuple[bytes, bytes]:
        kind = self.exact(1)
        (length,) = struct.unpack("!i", self.exact(4))
        return kind, self.exact(length - 4)

    def wait_readable(self) -> bool:
        """Wait for the client's next bytes (after the server's one-byte answer)."""
        if self.buf:
            return True
        data = self.sock.recv(65536)
        if not data:
            return False
        self.buf += data
        return True

    def drain(self) -> bytes:
        out = bytes(self.buf)
        self.buf.clear()
        return out


def _cstring(body: bytes, at: int) -> tuple[str, int]:
    end = body.index(b"\x00", at)
    return body[at:end].decode(errors="replace"), end + 1


def _error_response(sqlstate: str) -> bytes:
    fields = b"".join(
        code + value.encode() + b"\x00"
        for code, value in ((b"S", "ERROR"), (b"V", "ERROR"), (b"C", sqlstate), (b"M", "injected by tests/harness/pgfaults.py"))
    )
    payload = fields + b"\x00"
    return b"E" + struct.pack("!i", len(payload) + 4) + payload
