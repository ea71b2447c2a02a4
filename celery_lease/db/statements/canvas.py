"""Canvas statements (celery_lease/canvas.py, Store's chord counters): chord counters
and the results a chord body or a chain reads."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.sql.dml import ReturningDelete

from celery_lease.db.schema import ID, chords, jobs
from celery_lease.db.statements.common import (
    _ACTIVE,
    _c,
    _seconds,
    db_now,
    db_now_plus,
)
from celery_lease.db.statements.history import everywhere
from celery_lease.status import Status


def insert_chord(dialect: str) -> sa.Insert:
    """insert_chord: a chord's counter, before its header jobs exist. A second insert of
    the same group (the client re-applying a frozen chord) changes nothing."""
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    return (
        insert(chords)
        .values(
            id=sa.bindparam("group_id"),
            remaining=sa.bindparam("remaining"),
            members=sa.bindparam("members", type_=chords.c.members.type),
            body=sa.bindparam("body", type_=chords.c.body.type),
            created_at=db_now(),
        )
        .on_conflict_do_nothing(index_elements=[chords.c.id])
    )


@functools.cache
def count_down_chord() -> sa.Update:
    """count_down_chord: one header job succeeded. Runs in that job's success transaction;
    on PostgreSQL the row lock orders concurrent members, so exactly one sees 0."""
    return (
        sa.update(chords)
        .where(chords.c.id == sa.bindparam("group_id"), chords.c.remaining > 0)
        .values(remaining=chords.c.remaining - 1)
        .returning(chords.c.remaining, chords.c.members, chords.c.body)
    )


@functools.cache
def delete_chord() -> Any:
    """delete_chord: the body was created, or a header job failed (its errbacks fire once)."""
    return sa.delete(chords).where(chords.c.id == sa.bindparam("group_id")).returning(chords.c.body)


@functools.cache
def prune_chords(dialect: str) -> ReturningDelete:
    """prune_chords: a bounded chunk of chord counters created before :cutoff_seconds ago
    none of whose header jobs is pending or running: their body can no longer be
    created. (A header job that ends otherwise than by success removes its counter in
    that transaction; these are left by a header whose jobs were never written, or gone.)
    Returns the ids deleted."""
    if dialect == "postgresql":
        member = sa.func.jsonb_array_elements_text(chords.c.members).table_valued("value").alias("member")
        member_id: sa.ColumnElement = sa.cast(member.c.value, ID)
    else:  # SQLite stores a UUID as 32 hex digits
        member = sa.func.json_each(chords.c.members).table_valued("value").alias("member")
        member_id = sa.func.replace(member.c.value, "-", "")
    live = sa.select(sa.literal(1)).select_from(member).join(jobs, _c.id == member_id).where(_c.status.in_(_ACTIVE))
    old = sa.and_(chords.c.created_at < db_now_plus(-_seconds("cutoff_seconds")), ~live.exists())
    chunk = (
        sa.select(chords.c.id)
        .where(old)
        .order_by(chords.c.created_at)
        .limit(sa.bindparam("limit"))
        .with_for_update(skip_locked=True)  # a member's success transaction holds its chord
        .cte("orphaned")
        .prefix_with("MATERIALIZED")
    )
    where = chords.c.id == chunk.c.id if dialect == "postgresql" else chords.c.id.in_(sa.select(chunk.c.id))
    return sa.delete(chords).where(where).returning(chords.c.id)


def job_results(ids: Sequence[str]) -> sa.Select:
    # A chord's header jobs may have finished long before its last one: read them
    # wherever they live.
    return everywhere(sa.select(_c.id, _c.result).where(_c.id.in_(ids)))


@functools.cache
def make_due() -> sa.Update:
    """make_due: a pending job may be claimed now (eager mode runs retries at once)."""
    return sa.update(jobs).where(_c.id == sa.bindparam("job_id"), _c.status == Status.PENDING.value).values(run_after=None)
