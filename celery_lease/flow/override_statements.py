"""The statements of an operator's override of a kind's limits (the ``*_override``
columns of celery_lease_limits; see db/schema.py for their encoding). Every statement
that enforces a limit reads the limit in force through flow.statements.in_force_*;
these write the override and tell which kinds it limits, run by
:mod:`celery_lease.flow.store`."""

from __future__ import annotations

import functools

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from celery_lease.db.schema import jobs, limits, pauses
from celery_lease.db.statements.common import _PENDING, _c, db_now
from celery_lease.db.statements.in_force import in_force_per_seconds
from celery_lease.status import Held


@functools.cache
def override_limits(dialect: str) -> sa.Insert:
    """override_limits: set an operator's override of :of_kind's concurrency (when
    :set_concurrency) and rate (when :set_rate), creating its limits row if none exists
    (a kind that declares no limit in code). The other stays as it was.

    When the rate window length in force changes, the window starts again (its count
    at 0): the stored window numbers count windows of the old length. At most one
    window's worth of claims more may then start at the change."""
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    set_c, set_r = sa.bindparam("set_concurrency", type_=sa.Boolean), sa.bindparam("set_rate", type_=sa.Boolean)

    def given(flag: sa.BindParameter, name: str) -> sa.ColumnElement:
        # (Cast: PostgreSQL types a CASE of NULL parameters as text.)
        return sa.case((flag, sa.cast(sa.bindparam(name, type_=sa.Integer), sa.Integer)), else_=sa.null())

    stmt = insert(limits).values(
        kind=sa.bindparam("of_kind"),
        concurrency_override=given(set_c, "concurrency_override"),
        rate_override=given(set_r, "rate_override"),
        per_seconds_override=given(set_r, "per_seconds_override"),
        updated_at=db_now(),
    )
    new, old = stmt.excluded, limits.c
    rate = sa.case((set_r, new.rate_override), else_=old.rate_override)
    per = sa.case((set_r, new.per_seconds_override), else_=old.per_seconds_override)
    resized = in_force_per_seconds(old).is_distinct_from(sa.func.coalesce(per, old.per_seconds))
    return stmt.on_conflict_do_update(
        index_elements=[limits.c.kind],
        set_={
            "concurrency_override": sa.case((set_c, new.concurrency_override), else_=old.concurrency_override),
            "rate_override": rate,
            "per_seconds_override": per,
            "rate_window": sa.case((resized, 0), else_=old.rate_window),
            "rate_claims": sa.case((resized, 0), else_=old.rate_claims),
            "woken_window": sa.case((resized, 0), else_=old.woken_window),
            "updated_at": db_now(),
        },
    )


@functools.cache
def overridden_kinds() -> sa.Select:
    """The kinds an operator's override limits (a concurrency or a rate of N >= 1):
    their claims take the limited path even when the code declares no limit."""
    return sa.select(limits.c.kind).where(sa.or_(limits.c.concurrency_override > 0, limits.c.rate_override > 0))


@functools.cache
def kind_exists() -> sa.Select:
    """Whether :of_kind has any row: a job (of any status), a limits row or a pause."""
    return sa.select(
        sa.or_(
            sa.exists().where(limits.c.kind == sa.bindparam("of_kind")),
            sa.exists().where(pauses.c.kind == sa.bindparam("of_kind")),
            sa.exists().where(jobs.c.kind == sa.bindparam("of_kind")),
        )
    )


@functools.cache
def held_keys() -> sa.Select:
    """The concurrency keys of :of_kind's jobs held by its limit or its rate (read
    through the held index): what a changed limit may now let run."""
    return (
        sa.select(_c.concurrency_key)
        .distinct()
        .where(
            _c.status == _PENDING,
            _c.held.in_([Held.LIMIT.value, Held.RATE.value]),
            _c.kind == sa.bindparam("of_kind"),
        )
    )
