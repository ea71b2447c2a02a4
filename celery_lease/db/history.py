"""The store's history (PostgreSQL; see db/schema.py, "finished jobs past the hot
table"): moving finished jobs out of celery_lease_jobs, and the day partitions they
move into, made before they are needed and dropped whole when retention has passed.

A part of :class:`~celery_lease.db.store.Store` (its base); the statements are in
:mod:`celery_lease.db.statements.history`. On SQLite every method does nothing: its
jobs stay in the one table and the pruner deletes them there.
"""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any

import sqlalchemy as sa
from sqlalchemy import Engine

from celery_lease.db.statements import history as sql

log = logging.getLogger("celery_lease.maintenance")


def _days(first: dt.date, last: dt.date) -> list[dt.date]:
    return [first + dt.timedelta(days=n) for n in range((last - first).days + 1)]


def _end_of(day: dt.date) -> dt.datetime:
    return dt.datetime.combine(day + dt.timedelta(days=1), dt.time(), dt.timezone.utc)


class History:
    """History statements of a :class:`~celery_lease.db.engine.Database`."""

    dialect: str
    durable: Engine
    transaction: Any

    @property
    def has_history(self) -> bool:
        return self.dialect == "postgresql"

    def history_partitions(self) -> dict[str, list[dt.date]]:
        """The days each history table has a partition for, oldest first."""
        out: dict[str, list[dt.date]] = {t: [] for t in sql.TABLES}
        if not self.has_history:
            return out
        for (name,) in self.transaction(self.durable, lambda c: c.execute(sql.partitions()).all()):
            day = sql.partition_day(name)
            if day is not None:
                out[name.rsplit("_p", 1)[0]].append(day)
        return {t: sorted(days) for t, days in out.items()}

    def _partition_ddl(self, statements: list[sa.TextClause]) -> bool:
        """Partition DDL in one transaction, under the history's DDL lock; False when the
        parent's lock was not had within DDL_LOCK_TIMEOUT (tried again next tick)."""

        def work(conn):
            conn.execute(sql.DDL_LOCK_TIMEOUT)
            conn.execute(sql.DDL_LOCK)
            for stmt in statements:
                conn.execute(stmt)

        try:
            self.transaction(self.durable, work)
        except sa.exc.OperationalError as e:
            if getattr(e.orig, "pgcode", None) != "55P03":  # lock_not_available
                raise
            log.warning("celery-lease: history partitions busy (a long read holds them); next tick")
            return False
        return True

    def ensure_partitions(self, first: dt.date, last: dt.date) -> int:
        """Make every missing partition of both history tables for ``first`` .. ``last``
        (UTC days); returns how many were made."""
        have = self.history_partitions()
        ddl = [
            stmt
            for table in sql.TABLES
            for day in _days(first, last)
            if day not in have[table]
            for stmt in sql.create_partition(table, day)
        ]
        return len(ddl) // 2 if ddl and self._partition_ddl(ddl) else 0

    def prepare_archive(self, after_seconds: float) -> bool:
        """Whether a finished job is due to move (finished more than ``after_seconds``
        ago); if so, every partition it and the jobs after it can need is made first.
        Once per archive tick: its chunks then are one statement each."""
        if not self.has_history:
            return False
        params = {"after_seconds": after_seconds}
        oldest = self.transaction(self.durable, lambda c: c.execute(sql.oldest_archivable(), params).scalar())
        if oldest is None:
            return False
        today = dt.datetime.now(dt.timezone.utc).date()
        # Through tomorrow: the move's clock is a moment later than this one's.
        self.ensure_partitions(oldest.astimezone(dt.timezone.utc).date(), today + dt.timedelta(days=1))
        return True

    def archive(self, after_seconds: float, limit: int) -> int:
        """Move up to ``limit`` finished jobs (and their events) that finished more than
        ``after_seconds`` ago into the history (after prepare_archive); returns how many
        moved."""
        params = {"after_seconds": after_seconds, "limit": limit}
        return self.transaction(self.durable, lambda c: len(c.execute(sql.archive_jobs(), params).all()))

    def drop_history(self, older_than_seconds: float) -> int:
        """Drop the partitions (both tables) of every day that ended more than
        ``older_than_seconds`` ago; returns how many days were dropped. A day whose end
        is within the retention is kept whole: a finished job outlives the retention
        by less than a day."""
        if not self.has_history:
            return 0
        now = dt.datetime.now(dt.timezone.utc)
        cutoff = now - dt.timedelta(seconds=older_than_seconds)
        have = self.history_partitions()
        days = sorted({d for t in sql.TABLES for d in have[t] if _end_of(d) <= cutoff})
        ddl = [stmt for day in days for table in sql.TABLES if day in have[table] for stmt in sql.drop_partition(table, day)]
        return len(days) if ddl and self._partition_ddl(ddl) else 0
