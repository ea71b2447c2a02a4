"""Engines, connections and transactions of the job database.

The rule: two kinds of commit share one database. Durable (synchronous) for everything
anyone may have been told or may rely on: submit, cancel, reap, sweep, recovery, prune,
and the lease life (claim, renewal, success, failure, retry, handoff), so a reported
success or an issued fencing token survives a crash of PostgreSQL. Fast for progress and
checkpoint writes only (PostgreSQL: ``synchronous_commit = off``, a crash loses the last
few hundred milliseconds, which only repeats work); a statement marked durable
(:mod:`celery_lease.db.durability`) commits synchronously even there. Reads that may lag
(lists, counts, metrics) may run on a replica (``lagging``: lease_read_database_url),
nothing else. Database errors never carry the driver's text outward (it can hold host
names or credentials): DatabaseUnavailable names the setting (db/unreachable.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection, Engine

from celery_lease.db import durability, green, sqlite_errors, unreachable, urls
from celery_lease.db.in_flight import await_in_flight, backend_pid
from celery_lease.db.prepared import Prepared
from celery_lease.errors import DatabaseUnavailable

log = logging.getLogger("celery_lease")

T = TypeVar("T")

#: How often a statement is retried when its connection was dropped.
RECONNECT_ATTEMPTS = 3


def _before_retry(engine: Engine, pid: int | None, attempt: int, on_retry: Callable[[], None] | None) -> None:
    """Between tries of a statement whose connection dropped: the dropped backend's work
    is over (await_in_flight) before the retry looks at what landed."""
    log.warning("celery-lease: database connection dropped, retrying (%d)", attempt)
    await_in_flight(engine, pid)
    if on_retry is not None:
        on_retry()
    time.sleep(0.05 * attempt)


def _on_sqlite_connect(dbapi_conn, _record) -> None:
    # WAL lets readers run beside the one writer; the busy timeout makes writers
    # queue instead of failing while another process holds the write lock.
    dbapi_conn.isolation_level = None  # SQLAlchemy emits BEGIN itself (below)
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def _on_sqlite_begin(conn) -> None:
    # BEGIN IMMEDIATE takes the write lock up front: a deferred transaction that
    # reads and then writes can fail with SQLITE_BUSY without waiting.
    conn.exec_driver_sql("BEGIN IMMEDIATE")


@dataclasses.dataclass(frozen=True)
class Timeouts:
    """Seconds; 0 means none. PostgreSQL only (SQLite waits on its file lock)."""

    #: establishing a connection
    connect: float = 10.0
    #: one statement of the pooled connections (handlers' effects run there too)
    statement: float = 0.0
    #: the heartbeat's own connection: statement and lock timeout of a renewal
    heartbeat: float = 5.0
    #: the longest any statement of the pooled connections waits for a lock: a claim,
    #: a release, maintenance never queue behind a stuck holder for longer
    lock: float = 30.0
    #: a transaction of any connection idle this long (its client gone, partitioned
    #: mid-transaction) is ended by the server, and the locks it held are released;
    #: TCP keepalives alone took minutes. (Effects run in the success transaction: one
    #: that keeps it idle longer fails the attempt, which is retried.)
    idle_in_transaction: float = 120.0

    @classmethod
    def of(cls, settings: Any) -> Timeouts:
        """The timeouts of a celery_lease.settings.Settings (its ``*_timeout`` fields)."""
        s = settings
        return cls(s.connect_timeout, s.statement_timeout, s.heartbeat_timeout, s.lock_timeout, s.idle_in_transaction_timeout)


#: Pool size outside a worker (a web app, beat, the CLI); a worker sizes its pools from
#: its concurrency (Database.size_for_concurrency).
DEFAULT_POOL_SIZE = 4
DEFAULT_MAX_OVERFLOW = 8
#: A green worker's pools hold at most this many connections each, whatever its -c.
GREEN_POOL_SIZE = 12
#: Every connection: TCP keepalives find a peer that vanished (host down, network cut)
#: while the connection is idle, tcp_user_timeout while a request is unanswered.
KEEPALIVES = {"keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5, "keepalives_count": 3}
TCP_USER_TIMEOUT_MS = 60_000


#: The engines key of the replica's engine.
REPLICA = (False, False, False, True)


class Database:
    """One job database: its engines, pooled connections and transactions."""

    def __init__(
        self, url: str, *, source: str = "database_url", timeouts: Timeouts | None = None, read_url: str | None = None
    ) -> None:
        parsed = self.parse_url(url, source)
        self.url = parsed
        self.source = source
        self.dialect: str = parsed.get_backend_name()
        #: The replica for reads that may lag (``lagging``); None: the primary serves them.
        self.read_url = urls.parse_read_url(read_url, parsed) if read_url else None
        self.timeouts = timeouts or Timeouts()
        #: (fast, single, heartbeat, replica) -> engine
        self._engines: dict[tuple[bool, bool, bool, bool], Engine] = {}
        self._hot = threading.local()  # per thread: a held connection for prepared statements
        self._pid = os.getpid()
        self._pool_size = DEFAULT_POOL_SIZE
        self._max_overflow = DEFAULT_MAX_OVERFLOW
        #: Whether each thread keeps its own connection for prepared statements (a
        #: worker: threads are bounded by its concurrency). Elsewhere (a web app with
        #: any number of threads) a connection is taken from the pool per statement, so
        #: threads never pin more connections than the pool has.
        self._pin = False

    def size_for_concurrency(self, concurrency: int) -> None:
        """A worker running ``concurrency`` handlers at once (threads pool: in this
        process): each may hold a pinned connection for its claim and a pooled one for
        its success transaction, besides the completer and maintenance. Replaces the
        engines made so far (e.g. by the startup ping).

        A green pool (gevent, eventlet) gets at most GREEN_POOL_SIZE connections per
        engine, no overflow: its greenlets queue (cooperatively) for a pooled connection,
        so ``-c 100`` does not open a hundred connections per worker; and it pins none:
        each task runs in a new greenlet, and a connection pinned to one would be
        dropped with it, unreturned."""
        is_green = green.hub() is not None
        if is_green:
            self._pool_size, self._max_overflow = max(DEFAULT_POOL_SIZE, min(concurrency, GREEN_POOL_SIZE)), 0
        else:
            self._pool_size = max(DEFAULT_POOL_SIZE, concurrency + 4)
            self._max_overflow = max(DEFAULT_MAX_OVERFLOW, concurrency + 8)
        self._pin = not is_green
        self.dispose()

    #: Check a database URL at the boundary (celery_lease/db/urls.py).
    parse_url = staticmethod(urls.parse_url)

    # --- engines ---------------------------------------------------------------------

    @property
    def display_url(self) -> str:
        """The URL for messages and logs: the password masked, whether it is in the
        userinfo or in the query string (``?password=``, libpq's ``sslpassword``)."""
        return urls.masked(self.url)

    def _create_engine(self, *, fast: bool, single: bool, heartbeat: bool, replica: bool = False) -> Engine:
        kwargs: dict[str, Any] = {}
        if self.dialect == "sqlite":
            kwargs["connect_args"] = {"timeout": 30, "check_same_thread": False}
        else:
            connect_args: dict[str, Any] = {"application_name": "celery-lease", **KEEPALIVES}
            options = []
            if fast:
                options.append("-c synchronous_commit=off")
            if heartbeat:
                # Its own connection, never shared with handler traffic, so a renewal
                # never waits for a pool checkout; and it gives up quickly: the worker
                # then judges its leases by its own clock (Attempt.is_lost).
                kwargs.update(pool_size=1, max_overflow=0, pool_timeout=max(1.0, self.timeouts.heartbeat))
                ms = int(self.timeouts.heartbeat * 1000)
                options += [f"-c statement_timeout={ms}", f"-c lock_timeout={ms}"]
                connect_args["tcp_user_timeout"] = ms
                connect_args["connect_timeout"] = max(1, round(self.timeouts.heartbeat))
            else:
                kwargs.update(pool_size=self._pool_size, max_overflow=self._max_overflow)
                if self.timeouts.statement:
                    options.append(f"-c statement_timeout={int(self.timeouts.statement * 1000)}")
                if self.timeouts.lock:
                    options.append(f"-c lock_timeout={int(self.timeouts.lock * 1000)}")
                connect_args["tcp_user_timeout"] = TCP_USER_TIMEOUT_MS
                if self.timeouts.connect:
                    connect_args["connect_timeout"] = max(1, round(self.timeouts.connect))
            if self.timeouts.idle_in_transaction:
                options.append(f"-c idle_in_transaction_session_timeout={int(self.timeouts.idle_in_transaction * 1000)}")
            if options:
                connect_args["options"] = " ".join(options)
            kwargs["connect_args"] = connect_args
            if single or heartbeat:
                # One statement is its own transaction: no BEGIN and COMMIT round trips.
                kwargs["isolation_level"] = "AUTOCOMMIT"
        url = self.read_url if replica and self.read_url is not None else self.url
        engine = sa.create_engine(url, **kwargs)  # parse_url made sure its driver imports
        if self.dialect == "sqlite":
            sa.event.listen(engine, "connect", _on_sqlite_connect)
            sa.event.listen(engine, "begin", _on_sqlite_begin)
        else:
            sa.event.listen(engine, "before_cursor_execute", durability.on_cursor_execute, retval=True)
        return engine

    def engine(self, *, fast: bool = False, single: bool = False, heartbeat: bool = False, replica: bool = False) -> Engine:
        """The engine for durable or fast commits, transactional or single-statement,
        or the heartbeat's own (one connection, short timeouts), or the replica's
        (``replica``: lease_read_database_url; only ``lagging`` asks for it).

        SQLite has one engine: one file, no asynchronous commit, no network round trip.
        """
        # Pooled connections must never cross a fork: a child that inherited them
        # drops them (without closing the parent's sockets) and connects afresh.
        if os.getpid() != self._pid:
            for engine in self._engines.values():
                engine.dispose(close=False)
            self._engines.clear()
            self._hot = threading.local()
            self._pid = os.getpid()
        assert not replica or self.read_url is not None
        key = (False, False, False, False) if self.dialect == "sqlite" else (fast, single, heartbeat, replica)
        if key not in self._engines:
            self._engines[key] = self._create_engine(fast=key[0], single=key[1], heartbeat=key[2], replica=key[3])
        engine = self._engines[key]
        return engine

    @property
    def durable(self) -> Engine:
        return self.engine()

    @property
    def fast(self) -> Engine:
        return self.engine(fast=True)

    @property
    def lagging(self) -> Engine:
        """The engine for reads that may lag behind the primary (lists, counts,
        metrics): the replica of lease_read_database_url when set, else the primary's.
        Nothing that writes, nor a read that decides a write, runs here: a replica
        may not have the latest commits yet, and refuses writes."""
        return self.engine(replica=True) if self.read_url is not None else self.durable

    def dispose(self) -> None:
        for slot in ("fast", "durable"):
            raw = getattr(self._hot, slot, None)
            if raw is not None:
                raw.close()
        self._hot = threading.local()
        for engine in self._engines.values():
            engine.dispose()
        self._engines.clear()

    def ping(self) -> None:
        """Connect once; raise DatabaseUnavailable naming the setting on failure."""
        self.transaction(self.durable, lambda c: c.execute(sa.text("SELECT 1")))

    def ping_lagging(self) -> None:
        """ping() for the engine of reads that may lag (the replica, when one is set)."""
        self.transaction(self.lagging, lambda c: c.execute(sa.text("SELECT 1")))

    # --- transactions ----------------------------------------------------------------

    def transaction(
        self,
        engine: Engine,
        fn: Callable[[Connection], T],
        *,
        connection: Connection | None = None,
        on_retry: Callable[[], None] | None = None,
    ) -> T:
        """Run ``fn`` in one transaction and commit; in the caller's ``connection``
        when given (the caller commits). A dropped connection is retried a few times;
        any other database error surfaces as DatabaseUnavailable without the driver's
        message (which can carry host names or credentials).

        A connection that dropped during COMMIT leaves it unknown whether the work
        landed: a retried ``fn`` must be idempotent and check what landed; ``on_retry``
        is called before each retry so the caller knows."""
        if connection is not None:
            return fn(connection)
        for attempt in range(1, RECONNECT_ATTEMPTS + 1):
            pid = None
            try:
                with engine.begin() as conn:
                    pid = backend_pid(conn.connection.dbapi_connection)
                    return fn(conn)
            except sa_exc.DBAPIError as exc:
                if exc.connection_invalidated and attempt < RECONNECT_ATTEMPTS:
                    _before_retry(engine, pid, attempt, on_retry)
                    continue
                raise self.translate(exc, replica=self.read_url is not None and engine is self._engines.get(REPLICA)) from None
        raise AssertionError("unreachable")

    def translate(self, exc: sa_exc.DBAPIError, *, replica: bool = False) -> Exception:
        """A database error as the caller sees it: DatabaseUnavailable, naming the
        setting and never the driver's text, for a lost or refusing server (a lock
        timeout included); the error itself otherwise (SQLite's statement errors as
        ProgrammingError). ``replica``: it came from the replica's engine."""
        if isinstance(exc, (sa_exc.OperationalError, sa_exc.InterfaceError)) and self._unavailable(exc.orig):
            log.warning("celery-lease: database error: %s", exc.orig)
            if replica:
                assert self.read_url is not None
                where = f"the job database's replica {urls.masked(self.read_url)} ({urls.READ_SOURCE})"
            else:
                where = f"the job database {self.display_url} ({self.source})"
            url = self.read_url if replica and self.read_url is not None else self.url
            return DatabaseUnavailable(f"cannot reach {where}: {unreachable.reason(exc.orig, url)}")
        if self.dialect == "sqlite" and isinstance(exc, sa_exc.OperationalError) and exc.orig is not None:
            # The statement's own error (no such table, a syntax error): PostgreSQL's
            # ProgrammingError, and handled as one (a handler's error, "not migrated").
            return sa_exc.ProgrammingError(exc.statement, exc.params, exc.orig)
        return exc

    def _unavailable(self, orig: BaseException | None) -> bool:
        """Whether a driver's OperationalError or InterfaceError ``orig`` means the
        database is away (DatabaseUnavailable) rather than the statement's own error."""
        return self.dialect != "sqlite" or sqlite_errors.unavailable(orig)

    def execute_prepared(
        self, stmt: Prepared, params: dict[str, Any], *, fast: bool = False, on_retry: Callable[[], None] | None = None
    ) -> list[dict[str, Any]]:
        """Run a per-job statement alone (autocommit; asynchronous commit when ``fast``)
        as a server-side prepared statement on a raw driver connection; same retry and
        error rules as transaction() (a retried statement may have landed before its
        reply was lost: ``on_retry`` tells the caller to check)."""
        engine = self.engine(fast=fast, single=True)
        slot = "fast" if fast else "durable"
        for attempt in range(1, RECONNECT_ATTEMPTS + 1):
            # In a worker each thread keeps one connection per engine for these
            # statements (the claiming thread, the completer): no pool checkout, reset
            # and checkin per job. Elsewhere the pool lends one per statement (the
            # statement stays prepared on it: raw.info lives with the connection).
            raw = getattr(self._hot, slot, None) if self._pin else None
            if raw is None:
                try:
                    raw = engine.raw_connection()
                except (sa_exc.DBAPIError, engine.dialect.loaded_dbapi.Error) as exc:
                    # As transaction() on a failed connect: one clear error, no driver
                    # text. (The pool raises the driver's own error, unwrapped.)
                    orig = exc.orig if isinstance(exc, sa_exc.DBAPIError) else exc
                    log.warning("celery-lease: database error: %s", orig)
                    raise DatabaseUnavailable(
                        f"cannot reach the job database {self.display_url} ({self.source}): {unreachable.reason(orig, self.url)}"
                    ) from None
                if self._pin:
                    setattr(self._hot, slot, raw)
            pid = backend_pid(raw.dbapi_connection)
            try:
                columns, rows = stmt.execute(raw.dbapi_connection, raw.info, params)
                if not self._pin:
                    raw.close()  # back to the pool
                return [dict(zip(columns, row)) for row in rows]
            except engine.dialect.loaded_dbapi.Error as exc:
                dropped = engine.dialect.is_disconnect(exc, raw.dbapi_connection, None)
                if self._pin:
                    setattr(self._hot, slot, None)
                if dropped:
                    # As SQLAlchemy does on a disconnect: the pool's other idle
                    # connections likely died with this one (a restarted or
                    # terminating server), so replace the pool, not just this one.
                    raw.invalidate(exc)
                    engine.dispose()
                else:
                    raw.close()
                if dropped and attempt < RECONNECT_ATTEMPTS:
                    _before_retry(engine, pid, attempt, on_retry)
                    continue
                dbapi = engine.dialect.loaded_dbapi
                if isinstance(exc, (dbapi.OperationalError, dbapi.InterfaceError)) and self._unavailable(exc):
                    log.warning("celery-lease: database error: %s", exc)
                    raise DatabaseUnavailable(
                        f"cannot reach the job database {self.display_url} ({self.source}): {unreachable.reason(exc, self.url)}"
                    ) from None
                raise
        raise AssertionError("unreachable")
