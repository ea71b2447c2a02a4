"""The outbox: follow-ups that leave the database, written with the transition that sets
them off (celery_lease/db/schema.py, outbox)."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.functions import FunctionElement

from celery_lease.db.schema import outbox
from celery_lease.db.statements.common import _seconds, db_now, db_now_plus

#: A plain Celery signature to apply: payload {"sig": ..., "args": [...], "options": {...}}.
KIND_CELERY = "celery"

_o = outbox.c


class written_now(FunctionElement):
    """The database's clock when the row is written. On PostgreSQL, clock_timestamp():
    now() is the start of the transaction, and a transition that waited on a lock longer
    than the sweeper's age would commit rows the sweeper takes at once, while their
    writer is still sending them. (SQLite's clock is read per statement, after BEGIN
    IMMEDIATE took the lock.)"""

    type = sa.DateTime(timezone=True)
    inherit_cache = True


@compiles(written_now)
def _written_now(element, compiler, **kw):
    return "clock_timestamp()"


@compiles(written_now, "sqlite")
def _written_now_sqlite(element, compiler, **kw):
    return compiler.process(db_now(), **kw)


@functools.cache
def insert_outbox() -> sa.Insert:
    """insert_outbox: rows (:id, :kind, :payload) stamped with the database's clock at
    the write (written_now), which follows whatever lock the transition waited for."""
    return sa.insert(outbox).values(created_at=written_now())


def delete_outbox(ids: Sequence[str]) -> sa.Delete:
    """delete_outbox: rows sent."""
    return sa.delete(outbox).where(_o.id.in_(ids))


@functools.cache
def take_outbox(dialect: str) -> sa.Update:
    """take_outbox: at most :limit rows older than :age_seconds (their writer had time to
    send them and did not say so), stamped now, so another beat leaves them alone for
    :age_seconds; a crash after this statement delays them by that. PostgreSQL skips rows
    another beat holds; SQLite serializes writers."""
    old = sa.select(_o.id).where(_o.created_at < db_now_plus(-_seconds("age_seconds"))).order_by(_o.created_at)
    old = old.limit(sa.bindparam("limit", type_=sa.Integer))
    if dialect == "postgresql":
        old = old.with_for_update(skip_locked=True)
    return (
        sa.update(outbox)
        .where(_o.id.in_(old.scalar_subquery()))
        .values(created_at=db_now())
        .returning(_o.id, _o.kind, _o.payload)
    )
