"""The dashboard's reads and writes: one method per statement of
:mod:`celery_lease.db.statements.dashboard`, run on the job store's durable engine;
the job list, counts and throughput, which may lag, on its ``lagging`` one (the replica
of lease_read_database_url, when set). A read that decides an action (a bulk action's
selection, a job's own page with its buttons) stays on the primary.

Rows come back as dicts with ids as strings and times as aware UTC (SQLite returns
them naive), like the API's views.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy.engine import Connection

from celery_lease.db.reads import _view
from celery_lease.db.statements import dashboard as dq
from celery_lease.db.statements import flow as fs
from celery_lease.db.statements import sessions as sq
from celery_lease.db.store import Store


class DashboardStore:
    def __init__(self, store: Store) -> None:
        self._store = store

    def _read(self, fn, *, may_lag: bool = False):
        serial = self._store.dialect == "postgresql"

        def work(conn: Connection):
            if serial:
                conn.execute(dq.serial_reads())
            return fn(conn)

        return self._store.transaction(self._store.lagging if may_lag else self._store.durable, work)

    def _rows(self, stmt, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        return self._read(lambda c: [_view(r) for r in c.execute(stmt, params or {}).mappings()])

    # --- sessions (celery_lease.ops.dashboard.access) ------------------------------------

    def open_session(self, session: str, token: str, seconds: float, keep: int) -> None:
        """Open ``session`` for ``token``; the token keeps its ``keep`` newest sessions."""

        def work(conn: Connection) -> None:
            conn.execute(sq.drop_expired_sessions())
            conn.execute(sq.open_session(), {"id": session, "token": token, "seconds": seconds})
            conn.execute(sq.end_oldest_sessions(), {"id": session, "token": token, "keep": keep - 1})

        self._store.transaction(self._store.durable, work)

    def session_token(self, session: str) -> str | None:
        return self._store.transaction(self._store.durable, lambda c: c.execute(sq.session_token(), {"id": session}).scalar())

    def close_session(self, session: str) -> None:
        self._store.transaction(self._store.durable, lambda c: c.execute(sq.close_session(), {"id": session}))

    # --- jobs ----------------------------------------------------------------------------

    def page(
        self, f: dq.Filter, *, after: tuple[Any, str] | None, scan: int, limit: int, may_lag: bool = False
    ) -> tuple[list[dict[str, Any]], tuple[datetime, str] | None]:
        """Up to ``limit`` + 1 matching jobs among the next ``scan``, and, when fewer than
        ``limit`` + 1 matched, where that window ended (None: no job is left to scan).
        ``may_lag``: for showing only (the replica may serve it)."""

        def work(conn: Connection):
            rows = [_view(r) for r in conn.execute(dq.scan_jobs(f, after=after, scan=scan, limit=limit + 1)).mappings()]
            end = None
            if len(rows) <= limit:
                last = conn.execute(dq.scan_end(f, after=after, scan=scan)).mappings().first()
                if last is not None:
                    view = _view(last)
                    end = (view["created_at"], view["id"])
            return rows, end

        return self._read(work, may_lag=may_lag)

    def job(self, job_id: str, *, tenant: str | None, cap: int, payloads: bool = False) -> dict[str, Any] | None:
        rows = self._rows(dq.get_job_detail(job_id, tenant=tenant, cap=cap, payloads=payloads))
        return rows[0] if rows else None

    def job_events(self, job_id: str, limit: int) -> list[dict[str, Any]]:
        return self._rows(dq.job_events(job_id, limit))

    def run_events(self, run_id: str, *, tenant: str | None, limit: int) -> list[dict[str, Any]]:
        if tenant is None:
            rows = self._store.run_events(run_id, limit=limit)
        else:
            rows = self._store.tenant_run_events(run_id, tenant, limit=limit)
        return [_view(r) for r in rows]

    # --- counts and live figures ----------------------------------------------------------

    def counts(self, *, tenant: str | None, window: float) -> dict[str, list[dict[str, Any]]]:
        def work(conn: Connection):
            return {
                "active": [dict(zip(("kind", "key", "status", "held", "n"), r)) for r in conn.execute(fs.flow_counts(tenant))],
                "terminal": [dict(r) for r in conn.execute(dq.terminal_counts(tenant), {"window": window}).mappings()],
            }

        return self._read(work, may_lag=True)

    def live(self, *, tenant: str | None, window: float, cap: int) -> dict[str, Any]:
        """The database's time and minute; (kind, minute, count) of recent submits;
        (kind, status, minute, wait, run) of recent finishes: plain tuples, since
        there may be thousands."""

        def work(conn: Connection):
            params = {"window": window, "cap": cap}
            now, minute = conn.execute(dq.database_now()).one()
            return {
                "now": _view({"now": now})["now"],
                "minute": minute,
                "submits": [tuple(r) for r in conn.execute(dq.recent_submits(tenant), params)],
                "finishes": [tuple(r) for r in conn.execute(dq.recent_finishes(tenant), params)],
            }

        return self._read(work, may_lag=True)

    def rate_budgets(self) -> dict[str, dict[str, Any]]:
        """Kind -> its rate, window and the claims counted in the current window."""
        return {r["kind"]: r for r in self._rows(dq.rate_budgets())}

    # --- workers, leases, reconciliation ------------------------------------------------------

    def leases(self, *, tenant: str | None, limit: int) -> dict[str, Any]:
        def work(conn: Connection):
            return {
                "now": _view({"now": conn.execute(dq.database_now()).one()[0]})["now"],
                "running": [_view(r) for r in conn.execute(dq.running_leases(tenant, limit)).mappings()],
                "owners": [_view(r) for r in conn.execute(dq.leases_by_owner(tenant)).mappings()],
            }

        return self._read(work)

    def reconciliation(self, *, tenant: str | None, stale_seconds: float, limit: int, cap: int) -> dict[str, Any]:
        def work(conn: Connection):
            params = {"stale_seconds": stale_seconds}
            return {
                "stale": [_view(r) for r in conn.execute(dq.stale_wakeups(tenant, limit), params).mappings()],
                "stale_count": conn.execute(dq.count_capped(dq.unswept_jobs(tenant), cap), params).scalar_one(),
                "pending": [dict(r) for r in conn.execute(dq.pending_by_queue(tenant)).mappings()],
                "held": [_view(r) for r in conn.execute(dq.held_groups(tenant)).mappings()],
            }

        return self._read(work)

    def job_states(self, ids: list[str]) -> dict[str, str]:
        if not ids:
            return {}
        return {r["id"]: r["status"] for r in self._rows(dq.job_states(ids))}
