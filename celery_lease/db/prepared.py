"""Server-side prepared statements for the per-job statements on PostgreSQL.

Every job pays for its claim and its completion. Sent as text, each is parsed and
planned by PostgreSQL every time and walked by SQLAlchemy's execution machinery in
the worker; together that cost more than the statements' own work. A
:class:`Prepared` statement is compiled from its construct in :mod:`celery_lease.db.statements` once, is
PREPAREd once per database connection, and runs as ``EXECUTE`` on the raw driver
connection.

Invariant: the text is still the one named statement of the catalogue; only the way
it is sent changes. Set ``lease_prepare_statements = False`` behind a pooler that does
not keep sessions (pgbouncer in transaction mode before 1.21).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql.psycopg2 import PGDialect_psycopg2
from sqlalchemy.engine import Connection
from sqlalchemy.sql.elements import BinaryExpression

from celery_lease.db import durability
from celery_lease.db.statements.common import is_planned_once, row_dicts

# Compiles with $1, $2 ... placeholders (what PREPARE takes) and their order.
_DOLLAR = PGDialect_psycopg2(paramstyle="numeric_dollar")
_names = (f"celery_lease_{n}" for n in itertools.count())
_KEY = "celery_lease.prepared"
#: Sent before a statement marked statements.common.planned_once, in the same message.
GENERIC_PLAN = "SET LOCAL plan_cache_mode = force_generic_plan; "


def _inline_constants(stmt: sa.ClauseElement, column_keys: Sequence[str] | None) -> sa.ClauseElement:
    """``stmt`` with its constant bound values (statuses set, increments, LIMIT 1) written
    as SQL literals: every EXECUTE then sends, quotes and coerces only the caller's
    values. Values a caller passes stay parameters."""
    compiled: Any = stmt.compile(dialect=_DOLLAR, column_keys=column_keys)
    # A constant compared with a column stays bound: written as SQL, `status = 'pending'`
    # would imply a partial index's predicate, and the planner may then find one row by
    # id through celery_lease_jobs_pending (every pending row) instead of the primary key.
    compared = {
        id(side)
        for element in sa.sql.visitors.iterate(stmt)
        if isinstance(element, BinaryExpression)
        for side in (element.left, element.right)
        if isinstance(side, sa.BindParameter)
    }
    literals: dict[int, Any] = {}
    for key, bind in compiled.binds.items():
        value = compiled.params.get(key)
        if bind.required or id(bind) in compared or isinstance(value, bool) or not isinstance(value, (int, str)):
            continue
        process = bind.type.dialect_impl(_DOLLAR).literal_processor(_DOLLAR)
        if process is not None:
            literals[id(bind)] = sa.literal_column(process(value), type_=bind.type)

    def replace(element: Any) -> Any:
        return literals.get(id(element)) if isinstance(element, sa.BindParameter) else None

    if not literals:
        return stmt
    inlined = sa.sql.visitors.replacement_traverse(stmt, {}, replace)  # type: ignore[call-overload]
    try:
        inlined.compile(dialect=_DOLLAR, column_keys=column_keys)
    except sa.exc.CompileError:
        # The traversal copies a CTE once per place that names it (a CTE read by several
        # subqueries: claim_many_limited's caps), which SQLAlchemy refuses: bound as is.
        return stmt
    return inlined


class Prepared:
    """One statement, prepared lazily on each connection that runs it."""

    def __init__(self, stmt: sa.ClauseElement, column_keys: Sequence[str] | None = None) -> None:
        # column_keys: for an INSERT, the columns it binds (a missing value binds NULL).
        compiled: Any = _inline_constants(stmt, column_keys).compile(dialect=_DOLLAR, column_keys=column_keys)
        self.name = next(_names)
        self.parts: tuple[Prepared, ...] = (self,)  # prepared before it runs (a script: each part)
        self._order = list(compiled.positiontup)
        # The construct's own constants; a value the caller must give has none.
        self._defaults = {k: v for k, v in compiled.params.items() if not compiled.binds[k].required}
        self._json = set()
        types = []
        for key in self._order:
            bind_type = compiled.binds[key].type
            if isinstance(bind_type, sa.types.NullType):
                types.append("TEXT")
                continue
            impl = bind_type.dialect_impl(_DOLLAR)
            if isinstance(impl, sa.JSON):
                self._json.add(key)
            types.append(impl.compile(dialect=_DOLLAR))
        arguments = f" ({', '.join(types)})" if types else ""  # PREPARE name () is a syntax error
        self.prepare_sql = f"PREPARE {self.name}{arguments} AS {compiled.string}"
        placeholders = ", ".join(["%s"] * len(self._order))
        self.execute_sql = f"EXECUTE {self.name} ({placeholders})" if self._order else f"EXECUTE {self.name}"
        #: Declared on the statement (durability.durable): commits synchronously.
        self.durable = durability.is_durable(stmt)
        if self.durable:
            self.execute_sql = durability.SYNC_ON + self.execute_sql
        if is_planned_once(stmt):
            self.execute_sql = GENERIC_PLAN + self.execute_sql

    def values(self, params: dict[str, Any]) -> list[Any]:
        merged = {**self._defaults, **params}
        return [
            (None if merged.get(k) is None else json.dumps(merged[k])) if k in self._json else merged.get(k) for k in self._order
        ]

    def execute(self, dbapi_connection, info: dict, params: dict[str, Any]) -> tuple[list[str], Sequence[tuple]]:
        """Run on a raw driver connection; returns (column names, rows)."""
        prepared = info.setdefault(_KEY, set())
        with dbapi_connection.cursor() as cur:
            for part in self.parts:
                if part.name not in prepared:
                    cur.execute(part.prepare_sql)
                    prepared.add(part.name)
            cur.execute(self.execute_sql, self.values(params))
            if cur.description is None:
                return [], []
            return [d[0] for d in cur.description], cur.fetchall()

    def run(self, conn: Connection, params: dict[str, Any]) -> list[dict[str, Any]]:
        """Run on a SQLAlchemy connection (its transaction and error handling: a
        database that refuses or cannot be reached raises as any statement does)."""
        prepared = conn.connection.info.setdefault(_KEY, set())
        if self.name not in prepared:
            conn.exec_driver_sql(self.prepare_sql)
            prepared.add(self.name)
        return row_dicts(conn.exec_driver_sql(self.execute_sql, tuple(self.values(params))))


class PreparedScript(Prepared):
    """Prepared statements sent together as one simple query: one round trip, run as
    one implicit transaction (on an autocommit connection). Under READ COMMITTED each
    statement takes a new snapshot, so a statement after a lock sees what the lock's
    previous holder committed (flow control's "lock the kind, then count"). The rows
    are the last statement's."""

    def __init__(self, *parts: Prepared) -> None:
        self.parts = parts
        self.name = "+".join(p.name for p in parts)
        # A durable part carries SYNC_ON: its SET LOCAL holds for the whole script.
        self.execute_sql = "; ".join(p.execute_sql for p in parts)
        self.durable = any(p.durable for p in parts)

    def values(self, params: dict[str, Any]) -> list[Any]:
        return [value for part in self.parts for value in part.values(params)]
