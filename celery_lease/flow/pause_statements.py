"""The statements of a kind's pause row (celery_lease_pauses: a row pauses its kind; no
claim of it succeeds until resume deletes it). The claim and hold_job read it
(flow.statements); these write and list it, run by :mod:`celery_lease.flow.store`."""

from __future__ import annotations

import functools

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from celery_lease.db.schema import pauses
from celery_lease.db.statements.common import db_now


@functools.cache
def pause_kind(dialect: str) -> sa.Insert:
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    return (
        insert(pauses)
        .values(kind=sa.bindparam("of_kind"), paused_at=db_now())
        .on_conflict_do_nothing(index_elements=[pauses.c.kind])
    )


@functools.cache
def resume_kind() -> sa.Delete:
    return sa.delete(pauses).where(pauses.c.kind == sa.bindparam("of_kind"))


@functools.cache
def is_paused() -> sa.Select:
    return sa.select(pauses.c.kind).where(pauses.c.kind == sa.bindparam("of_kind"))


@functools.cache
def list_pauses() -> sa.Select:
    return sa.select(pauses).order_by(pauses.c.kind)
