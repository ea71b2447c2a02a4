"""The limits in force for a kind, and the concurrency guard that reads them: column
expressions over a limits row (celery_lease_limits), used by every flow statement
(:mod:`celery_lease.db.statements.flow`, the claim family) and the override's own.

A limits row holds what the kind's workers declare (concurrency, rate, per_seconds) and
an operator's override of each (NULL: none, the declared value binds; 0: explicitly no
limit; N: the limit). Every statement that enforces a limit reads it through these, so
an override binds the next claim of every worker, in the same statement, with no round
trip of its own. ``row``: a limits row's columns.
"""

from __future__ import annotations

import sqlalchemy as sa

from celery_lease.db.schema import jobs, limits
from celery_lease.db.statements.common import _RUNNING

#: An override of 0: explicitly no limit (literal SQL: a generic plan sees the constant).
_NONE: sa.ColumnClause[int] = sa.literal_column("0")


def in_force_concurrency(row) -> sa.ColumnElement:
    """Jobs of one key that may run at once; NULL: no limit."""
    return sa.func.nullif(sa.func.coalesce(row.concurrency_override, row.concurrency), _NONE)


def in_force_rate(row) -> sa.ColumnElement:
    """Claims per window; NULL: no rate limit."""
    return sa.func.nullif(sa.func.coalesce(row.rate_override, row.rate), _NONE)


def in_force_per_seconds(row) -> sa.ColumnElement:
    """The length of a rate window in force: the override's when it sets a rate (its
    per_seconds_override is set exactly then), else the declared one. (COALESCE, not a
    CASE on rate_override: SQLite 3.40 returned NULL for that CASE in RETURNING.)"""
    return sa.func.coalesce(row.per_seconds_override, row.per_seconds)


def overridden(row) -> sa.ColumnElement[bool]:
    """An operator's override sets a limit (a concurrency or a rate of N >= 1)."""
    return sa.or_(row.concurrency_override > 0, row.rate_override > 0)


def not_overridden(kind) -> sa.ColumnElement[bool]:
    """No operator's override limits ``kind``: the guard of a claim that checks no limit,
    so a claim made after an override committed never bypasses it (the caller claims
    again on the limited path)."""
    row = limits.alias("override")
    return ~sa.exists().where(row.c.kind == kind, overridden(row.c))


def _concurrency_of(kind) -> sa.ScalarSelect:
    """The concurrency in force for ``kind`` (NULL: no limit, or no limits row)."""
    row = limits.alias("cap")
    return sa.select(in_force_concurrency(row.c)).where(row.c.kind == kind).scalar_subquery()


def below_concurrency(kind, key) -> sa.ColumnElement[bool]:
    """Fewer jobs of ``kind`` and ``key`` run than its concurrency in force allows (true
    without one)."""
    cap = _concurrency_of(kind)
    return sa.or_(cap.is_(None), running_like(kind, key) < cap)


def running_like(kind, key) -> sa.ScalarSelect:
    """How many jobs of ``kind`` and concurrency key ``key`` are running."""
    slots = jobs.alias("slots")
    return (
        sa.select(sa.func.count())
        .select_from(slots)
        .where(
            slots.c.status == _RUNNING,
            slots.c.kind == kind,
            slots.c.concurrency_key.is_not_distinct_from(key),
        )
        .scalar_subquery()
    )
