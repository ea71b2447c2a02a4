"""The job store: engines, transactions, and one method per named statement.

Two engines share one database:

* ``durable`` runs what a caller was told succeeded (submit, cancel, reap, sweep,
  recovery, prune): these commit synchronously.
* ``fast`` runs what only an attempt's own lease protects (claim, heartbeat, progress,
  checkpoint, completion). On PostgreSQL it commits with ``synchronous_commit = off``:
  a crash of PostgreSQL can lose the last few hundred milliseconds of such commits, and
  each loss is safe — a lost claim or heartbeat leaves the job pending or running under
  an old lease, which the reaper requeues; a lost completion (with the handler's own rows
  in the same transaction, since they commit or vanish together) leaves the job running,
  so it is reaped and runs again, and its effects are written exactly once by the attempt
  that does commit. WAL order means a later durable commit (e.g. a cancel) can never
  survive while an earlier async commit it depends on is lost.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable, Sequence, TypeVar

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection, Engine, make_url

from . import queries as q
from .errors import ConfigurationError, DatabaseUnavailable
from .job import Job
from .prepared import Prepared
from .status import Event

log = logging.getLogger("celery_lease")

T = TypeVar("T")

DEFAULT_SQLITE_PATH = "celery-lease.sqlite3"
#: How often a statement is retried when its connection was dropped.
RECONNECT_ATTEMPTS = 3


def resolve_database_url(explicit: str | None, app_conf: Any) -> tuple[str, str]:
    """Return (url, where it came from). Precedence: argument, app.conf, environment,
    then a SQLite file in the working directory."""
    if explicit:
        return explicit, "database_url"
    conf_value = app_conf.get("lease_database_url") if app_conf is not None else None
    if conf_value:
        return conf_value, "app.conf.lease_database_url"
    env_value = os.environ.get("CELERY_LEASE_DATABASE_URL")
    if env_value:
        return env_value, "CELERY_LEASE_DATABASE_URL"
    return f"sqlite:///{os.path.abspath(DEFAULT_SQLITE_PATH)}", "default SQLite file"


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


class Store:
    """Owns the engines and runs every named statement of :mod:`celery_lease.queries`."""

    def __init__(self, url: str, *, source: str = "database_url", prepare_statements: bool = True) -> None:
        try:
            parsed = make_url(url)
        except sa_exc.ArgumentError:
            raise ConfigurationError(
                f"{source} is not a valid database URL: {url!r} "
                "(expected e.g. postgresql+psycopg2://user@host/db or sqlite:///path)"
            ) from None
        if parsed.get_backend_name() not in ("postgresql", "sqlite"):
            raise ConfigurationError(
                f"{source} names the unsupported database {parsed.get_backend_name()!r}: "
                "celery-lease runs on PostgreSQL or SQLite"
            )
        self.url = parsed
        self.source = source
        self.dialect = parsed.get_backend_name()
        self._engines: dict[tuple[bool, bool], Engine] = {}
        self._hot = threading.local()  # per thread: a held connection for prepared statements
        self._pid = os.getpid()
        #: The per-job statements, prepared server-side (PostgreSQL only).
        self._prepared: dict[str, Prepared] | None = None
        if self.dialect == "postgresql" and prepare_statements:
            self._prepared = {
                "claim": Prepared(q.claim_job_logged()),
                "insert": Prepared(q.insert_jobs(self.dialect, on_key_conflict_nothing=False),
                                   column_keys=q.INSERTED_COLUMNS),
            }

    # --- engines ---------------------------------------------------------------------

    @property
    def display_url(self) -> str:
        return self.url.render_as_string(hide_password=True)

    def _create_engine(self, *, fast: bool, single: bool) -> Engine:
        kwargs: dict[str, Any] = {}
        if self.dialect == "sqlite":
            kwargs["connect_args"] = {"timeout": 30, "check_same_thread": False}
        else:
            kwargs["pool_size"] = 4
            kwargs["max_overflow"] = 8
            kwargs["connect_args"] = {"connect_timeout": 10, "application_name": "celery-lease"}
            if fast:
                kwargs["connect_args"]["options"] = "-c synchronous_commit=off"
            if single:
                # One statement is its own transaction: no BEGIN and COMMIT round trips.
                kwargs["isolation_level"] = "AUTOCOMMIT"
        try:
            engine = sa.create_engine(self.url, **kwargs)
        except (sa_exc.NoSuchModuleError, ImportError) as exc:
            raise ConfigurationError(
                f"{self.source}: no driver for {self.url.drivername!r} ({type(exc).__name__})"
            ) from None
        if self.dialect == "sqlite":
            sa.event.listen(engine, "connect", _on_sqlite_connect)
            sa.event.listen(engine, "begin", _on_sqlite_begin)
        return engine

    def engine(self, *, fast: bool = False, single: bool = False) -> Engine:
        """The engine for durable or fast commits, transactional or single-statement.

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
        key = (False, False) if self.dialect == "sqlite" else (fast, single)
        engine = self._engines.get(key)
        if engine is None:
            engine = self._engines[key] = self._create_engine(fast=key[0], single=key[1])
        return engine

    @property
    def durable(self) -> Engine:
        return self.engine()

    @property
    def fast(self) -> Engine:
        return self.engine(fast=True)

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
        self.run(self.durable, lambda c: c.execute(sa.text("SELECT 1")))

    # --- transactions ----------------------------------------------------------------

    def run(self, engine: Engine, fn: Callable[[Connection], T], *, connection: Connection | None = None) -> T:
        """Run ``fn`` in one transaction and commit; in the caller's ``connection``
        when given (the caller commits). A dropped connection is retried a few times;
        any other database error surfaces as DatabaseUnavailable without the driver's
        message (which can carry host names or credentials)."""
        if connection is not None:
            return fn(connection)
        for attempt in range(1, RECONNECT_ATTEMPTS + 1):
            try:
                with engine.begin() as conn:
                    return fn(conn)
            except sa_exc.DBAPIError as exc:
                if exc.connection_invalidated and attempt < RECONNECT_ATTEMPTS:
                    log.warning("celery-lease: database connection dropped, retrying (%d)", attempt)
                    time.sleep(0.05 * attempt)
                    continue
                if isinstance(exc, (sa_exc.OperationalError, sa_exc.InterfaceError)):
                    log.warning("celery-lease: database error: %s", exc.orig)
                    raise DatabaseUnavailable(
                        f"cannot reach the job database {self.display_url} ({self.source}): "
                        f"{type(exc.orig).__name__}"
                    ) from None
                raise
        raise AssertionError("unreachable")

    def execute_prepared(self, stmt: Prepared, params: dict[str, Any], *, fast: bool = True) -> list[dict[str, Any]]:
        """Run a per-job statement alone (autocommit; asynchronous commit when ``fast``)
        as a server-side prepared statement on a raw driver connection; same retry and
        error rules as run()."""
        engine = self.engine(fast=fast, single=True)
        slot = "fast" if fast else "durable"
        for attempt in range(1, RECONNECT_ATTEMPTS + 1):
            # Each thread keeps one connection per engine for these statements (the
            # claiming thread, the completer, a submitting thread): no pool checkout,
            # reset and checkin per job.
            raw = getattr(self._hot, slot, None)
            if raw is None:
                raw = engine.raw_connection()
                setattr(self._hot, slot, raw)
            try:
                columns, rows = stmt.execute(raw.dbapi_connection, raw.info, params)
                return [dict(zip(columns, row)) for row in rows]
            except engine.dialect.loaded_dbapi.Error as exc:
                dropped = engine.dialect.is_disconnect(exc, raw.dbapi_connection, None)
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
                    log.warning("celery-lease: database connection dropped, retrying (%d)", attempt)
                    time.sleep(0.05 * attempt)
                    continue
                if isinstance(exc, (engine.dialect.loaded_dbapi.OperationalError,
                                    engine.dialect.loaded_dbapi.InterfaceError)):
                    log.warning("celery-lease: database error: %s", exc)
                    raise DatabaseUnavailable(
                        f"cannot reach the job database {self.display_url} ({self.source}): "
                        f"{type(exc).__name__}"
                    ) from None
                raise
        raise AssertionError("unreachable")

    # --- producer --------------------------------------------------------------------

    def insert_jobs(self, rows: list[dict[str, Any]], *, keyed: bool, connection=None) -> list[Job]:
        if self._prepared is not None and len(rows) == 1 and not keyed and connection is None:
            # A plain single submit: one prepared INSERT, committed durably.
            return [Job.from_row(r) for r in self.execute_prepared(self._prepared["insert"], rows[0], fast=False)]
        stmt = q.insert_jobs(self.dialect, on_key_conflict_nothing=keyed)

        def work(conn: Connection) -> list[Job]:
            if len(rows) == 1:
                result = conn.execute(stmt, rows[0])
            else:
                result = conn.execute(stmt, rows)
            return [Job.from_row(r) for r in result.mappings()]

        # The INSERT is one statement: outside a caller's transaction it commits alone.
        return self.run(self.engine(single=True), work, connection=connection)

    def get_jobs_by_keys(self, kind: str, keys: Sequence[str], *, connection=None) -> list[Job]:
        def work(conn):
            return [Job.from_row(r) for r in conn.execute(q.get_jobs_by_keys(kind, keys)).mappings()]

        return self.run(self.durable, work, connection=connection)

    def mark_not_woken(self, ids: Sequence[str]) -> None:
        self.run(self.durable, lambda c: c.execute(q.mark_not_woken(ids)))

    def ensure_run(self, run_id: str, *, connection=None) -> bool:
        """Create the run if new; return False when the run was cancelled."""

        def work(conn):
            conn.execute(q.upsert_run(self.dialect, run_id))
            return conn.execute(q.get_run(run_id)).mappings().one()["cancelled_at"] is None

        return self.run(self.durable, work, connection=connection)

    # --- reads -----------------------------------------------------------------------

    def get(self, job_id: str) -> Job | None:
        def work(conn):
            row = conn.execute(q.get_job(job_id)).mappings().first()
            return None if row is None else Job.from_row(row)

        return self.run(self.durable, work)

    def list(self, **filters) -> list[Job]:
        return self.run(
            self.durable, lambda c: [Job.from_row(r) for r in c.execute(q.list_jobs(**filters)).mappings()]
        )

    def run_events(self, run_id: str, *, after_id: int = 0, limit: int = 1000,
                   tenant: str | None = None) -> list[dict]:
        stmt = q.list_run_events(run_id, after_id=after_id, limit=limit, tenant=tenant)
        return self.run(self.durable, lambda c: [dict(r) for r in c.execute(stmt).mappings()])

    def metrics(self, stale_seconds: float) -> dict[str, Any]:
        """The aggregates behind /metrics, read in one transaction."""

        def work(conn):
            return {
                "jobs": [tuple(r) for r in conn.execute(q.job_totals())],
                "events": [tuple(r) for r in conn.execute(q.event_totals())],
                "leases": tuple(conn.execute(q.lease_health(), {"stale_seconds": stale_seconds}).one()),
            }

        return self.run(self.durable, work)

    # --- lease life ------------------------------------------------------------------

    def claim(self, job_id: str, owner: str) -> dict[str, Any] | None:
        """Claim a job for one attempt; None when the delivery is a duplicate."""

        params = {"job_id": job_id, "owner": owner}
        if self._prepared is not None:
            rows = self.execute_prepared(self._prepared["claim"], params)
            return rows[0] if rows else None
        if self.dialect == "postgresql":
            row = self.run(self.engine(fast=True, single=True),
                           lambda conn: conn.execute(q.claim_job_logged(), params).mappings().first())
            return None if row is None else dict(row)

        def work(conn):
            row = conn.execute(q.claim_job(), params).mappings().first()
            if row is not None and row["run_id"] is not None:
                self._append(conn, [q.event_row(row["run_id"], job_id, Event.CLAIMED, row["attempt"], owner)])
            return None if row is None else dict(row)

        return self.run(self.fast, work)

    def renew(self, leases: Sequence[tuple[str, int]]) -> set[str]:
        """Renew many leases in one statement; return the ids still held."""

        def work(conn):
            return {str(r[0]) for r in conn.execute(q.renew_leases(leases))}

        return self.run(self.engine(fast=True, single=True), work)

    def complete_many(self, params: dict[str, Any], count: int) -> set[str]:
        """complete_jobs for ``count`` attempts; returns the ids that completed."""
        if self._prepared is not None:
            key = f"complete_{count}"
            stmt = self._prepared.get(key) or self._prepared.setdefault(key, Prepared(q.complete_jobs(count)))
            return {str(r["id"]) for r in self.execute_prepared(stmt, params)}
        return self.run(self.engine(fast=True, single=True),
                        lambda conn: {str(r[0]) for r in conn.execute(q.complete_jobs(count), params)})

    def fenced(self, conn: Connection, stmt, **params) -> bool:
        """Run a guarded write of an attempt; False means the lease is lost."""
        return conn.execute(stmt, params).rowcount == 1

    def write_fenced(self, stmt, **params) -> bool:
        """One fenced statement of an attempt, committed on its own."""
        return self.run(self.engine(fast=True, single=True), lambda conn: self.fenced(conn, stmt, **params))

    def _append(self, conn: Connection, rows: list[dict]) -> None:
        if rows:
            conn.execute(q.append_events(), rows)

    def append_events(self, rows: list[dict], *, connection=None) -> None:
        self.run(self.durable, lambda c: self._append(c, rows), connection=connection)

    # --- revoking statements ---------------------------------------------------------

    def cancel(self, *, job_id: str | None = None, run_id: str | None = None) -> list[str]:
        def work(conn):
            if run_id is not None:
                conn.execute(q.upsert_run(self.dialect, run_id))
                conn.execute(q.cancel_run(), {"run_id": run_id})
            rows = conn.execute(q.cancel_jobs(job_id=job_id, run_id=run_id)).mappings().all()
            self._append(conn, [
                q.event_row(r["run_id"], r["id"], Event.CANCELLED, r["attempt"])
                for r in rows if r["run_id"] is not None
            ])
            return [str(r["id"]) for r in rows]

        return self.run(self.durable, work)

    def _requeue(self, stmt, params: dict, event: Event, cause: str) -> list[dict]:
        def work(conn):
            rows = [dict(r) for r in conn.execute(stmt, params).mappings()]
            self._append(conn, [
                q.event_row(r["run_id"], r["id"], event, r["attempt"], f"{cause}: {r['status']}")
                for r in rows if r["run_id"] is not None
            ])
            return rows

        return self.run(self.durable, work)

    def reap(self, limit: int) -> list[dict]:
        return self._requeue(q.reap_expired(), {"limit": limit}, Event.REAPED, "lease expired")

    def recover(self, node: str, boot: str) -> list[dict]:
        stmt = q.recover_restarted(owner_prefix=f"{node}/", owner_boot=f"/{boot}")
        return self._requeue(stmt, {}, Event.REQUEUED, "interrupted by restart")

    def claim_due_wakeups(self, stale_seconds: float, limit: int) -> list[dict]:
        return self.run(
            self.durable,
            lambda c: [dict(r) for r in c.execute(
                q.claim_due_wakeups(), {"stale_seconds": stale_seconds, "limit": limit}).mappings()],
        )

    def prune(self, older_than_seconds: float, limit: int) -> int:
        def work(conn):
            ids = [str(r[0]) for r in conn.execute(
                q.prunable_jobs(), {"cutoff_seconds": older_than_seconds, "limit": limit})]
            if not ids:
                return 0
            conn.execute(q.delete_job_events(ids))
            return conn.execute(q.delete_jobs(ids)).rowcount

        return self.run(self.durable, work)
