"""The store's chord counters (see :mod:`celery_lease.canvas`): one row per applied
chord, counted down by its header jobs' successes, removed when the body is created,
when a header job fails, expires or is cancelled, or by the pruner.

A part of :class:`~celery_lease.db.store.Store` (its base); the statements are in
:mod:`celery_lease.db.statements.canvas`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.engine import Connection

from celery_lease.db.statements import canvas


class Chords:
    """Chord statements of a :class:`~celery_lease.db.engine.Database`."""

    dialect: str
    durable: Engine
    transaction: Any

    def create_chord(self, group_id: str, members: list[str], body: Any) -> None:
        stmt = canvas.insert_chord(self.dialect)
        params = {"group_id": group_id, "remaining": len(members), "members": members, "body": body}
        self.transaction(self.durable, lambda c: c.execute(stmt, params))

    def count_down_chord(self, conn: Connection, group_id: str) -> dict[str, Any] | None:
        """In a member's success transaction: the chord row after this member, or None
        when the chord is gone (failed) or already complete."""
        row = conn.execute(canvas.count_down_chord(), {"group_id": group_id}).mappings().first()
        return None if row is None else dict(row)

    def delete_chord(self, conn: Connection, group_id: str) -> Any:
        """Remove a chord; its body's signature, or None when it was already removed."""
        row = conn.execute(canvas.delete_chord(), {"group_id": group_id}).first()
        return None if row is None else row[0]

    def job_results(self, conn: Connection, ids: Sequence[str]) -> dict[str, Any]:
        return {str(r[0]): r[1] for r in conn.execute(canvas.job_results(ids))}

    def prune_chords(self, older_than_seconds: float, limit: int) -> int:
        params = {"cutoff_seconds": older_than_seconds, "limit": limit}
        return self.transaction(self.durable, lambda conn: len(conn.execute(canvas.prune_chords(self.dialect), params).all()))
