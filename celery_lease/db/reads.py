"""The store's reads: jobs, their API views, run events and the /metrics aggregates.

A part of :class:`~celery_lease.db.store.Store` (its base), kept apart from the
statements that change jobs; each method runs one named read of
:mod:`celery_lease.db.statements.reads` or :mod:`~celery_lease.db.statements.metrics`
in its own transaction.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import Engine

from celery_lease.db.statements import metrics as metrics_sql
from celery_lease.db.statements import reads
from celery_lease.job import Job


def _view(row: Mapping[Any, Any]) -> dict[str, Any]:
    """An API view row: ids as strings, times as aware UTC (SQLite returns them naive)."""
    out = dict(row)
    for key, value in out.items():
        if isinstance(value, datetime) and value.tzinfo is None:
            out[key] = value.replace(tzinfo=timezone.utc)
        elif key.endswith("id") and value is not None:
            out[key] = str(value)
    return out


class Reads:
    """Reads of a :class:`~celery_lease.db.engine.Database` (``transaction``, ``durable``)."""

    durable: Engine
    #: Reads that may lag (lists, metrics) run here: the replica, when one is set.
    lagging: Engine
    transaction: Any

    def get(self, job_id: str) -> Job | None:
        def work(conn):
            row = conn.execute(reads.get_job(job_id)).mappings().first()
            return None if row is None else Job.from_row(row)

        return self.transaction(self.durable, work)

    def checkpoint(self, job_id: str) -> Any:
        """One job's checkpoint (None: none saved, or no such job)."""
        return self.transaction(self.durable, lambda c: c.execute(reads.get_checkpoint(job_id)).scalar())

    def ids_with_prefix(self, prefix: str, limit: int) -> list[str]:
        """Up to ``limit`` job ids that start with ``prefix`` (lowercase hex digits of the
        id, without hyphens), in order."""
        low, high = (str(uuid.UUID(hex=prefix.ljust(32, pad))) for pad in "0f")
        stmt = reads.ids_between(low, high, limit)
        return self.transaction(self.durable, lambda c: [str(i) for i in c.execute(stmt).scalars()])

    def list_jobs(self, **filters) -> list[Job]:
        """A list that may lag (lease_read_database_url): for showing, never for deciding."""
        return self.transaction(
            self.lagging, lambda c: [Job.from_row(r) for r in c.execute(reads.list_jobs(**filters)).mappings()]
        )

    def get_view(self, job_id: str, *, tenant: str | None = None) -> dict[str, Any] | None:
        """The API columns of one job (of ``tenant``, when given), or None."""

        def work(conn):
            row = conn.execute(reads.get_job_view(job_id, tenant=tenant)).mappings().first()
            return None if row is None else _view(row)

        return self.transaction(self.durable, work)

    def list_summaries(self, *, max_value_bytes: int, **filters) -> list[dict[str, Any]]:
        """list_jobs reading only the API columns, result and progress bounded (see
        reads.list_job_summaries)."""
        stmt = reads.list_job_summaries(max_value_bytes=max_value_bytes, **filters)
        return self.transaction(self.lagging, lambda c: [_view(r) for r in c.execute(stmt).mappings()])

    def run_visible(self, run_id: str, *, tenant: str | None = None) -> bool:
        return self.transaction(self.durable, lambda c: c.execute(reads.run_visible(run_id, tenant=tenant)).first() is not None)

    def tenant_run_events(self, run_id: str, tenant: str, *, after_seq: int = 0, limit: int = 1000) -> list[dict]:
        """A tenant's events of a run, each with its ``seq`` among them (see reads)."""
        stmt = reads.list_tenant_run_events(run_id, tenant, after_seq=after_seq, limit=limit)
        return self.transaction(self.durable, lambda c: [dict(r) for r in c.execute(stmt).mappings()])

    def run_events(self, run_id: str, *, after_id: int = 0, limit: int = 1000, tenant: str | None = None) -> list[dict]:
        stmt = reads.list_run_events(run_id, after_id=after_id, limit=limit, tenant=tenant)
        return self.transaction(self.durable, lambda c: [dict(r) for r in c.execute(stmt).mappings()])

    def metrics(self, stale_seconds: float) -> dict[str, Any]:
        """The aggregates behind /metrics, read in one transaction."""

        def work(conn):
            return {
                "jobs": [tuple(r) for r in conn.execute(metrics_sql.job_totals())],
                "events": [tuple(r) for r in conn.execute(metrics_sql.event_totals())],
                "leases": tuple(conn.execute(metrics_sql.lease_health(), {"stale_seconds": stale_seconds}).one()),
            }

        return self.transaction(self.lagging, work)
