"""Durability is declared on the statement, never chosen where it runs.

Whatever bumps a lease generation (a claim, cancel, reap, restart recovery) or ends
an attempt issues or revokes a fencing token that must never be issued twice, also
across a crash of PostgreSQL. Such a statement is marked :func:`durable` in the
catalogue; on PostgreSQL it then always runs as ``SET LOCAL synchronous_commit = on;
<statement>`` (one message: its transaction, implicit or not, commits synchronously),
whatever engine, pool or transport runs it: a fast (asynchronous-commit) engine, a
prepared statement or script, ``lease_prepare_statements = False``.
"""

from __future__ import annotations

from typing import Any, TypeVar

S = TypeVar("S")

#: The execution option that marks a statement durable.
OPTION = "celery_lease_durable"
#: Sent before a durable statement, in the same message (PostgreSQL).
SYNC_ON = "SET LOCAL synchronous_commit = on; "


def durable(stmt: S) -> S:
    """``stmt``, marked to commit synchronously wherever it runs."""
    return stmt.execution_options(**{OPTION: True})  # type: ignore[attr-defined]


def is_durable(stmt: Any) -> bool:
    return bool(stmt.get_execution_options().get(OPTION, False))


def on_cursor_execute(conn, cursor, statement, parameters, context, executemany):
    """SQLAlchemy's before_cursor_execute (PostgreSQL engines): a durable statement
    goes with SYNC_ON in front."""
    if context is not None and context.execution_options.get(OPTION):
        statement = SYNC_ON + statement
    return statement, parameters
