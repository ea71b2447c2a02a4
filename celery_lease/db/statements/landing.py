"""A transaction's fate after a lost reply (celery_lease/db/landing.py)."""

from __future__ import annotations

import functools
from typing import Any

import sqlalchemy as sa


@functools.cache
def transaction_mark(lock_timeout: bool) -> sa.Select:
    """The current transaction's id (as text: an xid8), its server process and when
    that server started (epoch seconds, as text), taken before COMMIT so a lost reply
    can be settled by asking the server; with ``lock_timeout``, also ``SET LOCAL
    lock_timeout = :lock_timeout_ms`` in the same round trip (background transitions
    never wait on a row lock for long)."""
    columns: list[Any] = [
        sa.cast(sa.func.pg_current_xact_id(), sa.Text),
        sa.func.pg_backend_pid(),
        # As the epoch (numeric, exact to the microsecond), not timestamptz text, which
        # follows the session's TimeZone and DateStyle.
        sa.cast(sa.extract("epoch", sa.func.pg_postmaster_start_time()), sa.Text),
    ]
    if lock_timeout:
        columns.append(sa.func.set_config("lock_timeout", sa.cast(sa.bindparam("lock_timeout_ms"), sa.Text), True))
    return sa.select(*columns)


@functools.cache
def transaction_status() -> sa.TextClause:
    """'committed', 'aborted' or 'in progress' of transaction :xid (NULL: too old to
    know), or 'restarted' when the server is no longer the one that started at
    :started.

    Why 'restarted' wins: an xid whose WAL never reached the disk is forgotten by a
    crash, and the recovered server hands it out again. Before another transaction
    takes it, pg_xact_status raises "transaction ID is in the future" (SQLSTATE 22023,
    seen in the history test); after, it answers for that other transaction, so a
    'committed' would be somebody else's. Across a restart the xid says nothing about
    our transaction: the caller runs its work again, fenced (a transition that had
    committed then matches no row)."""
    return sa.text(
        "SELECT CASE WHEN extract(epoch FROM pg_postmaster_start_time()) <> CAST(:started AS numeric) THEN 'restarted'"
        " ELSE pg_xact_status(CAST(:xid AS xid8)) END"
    )


@functools.cache
def end_stranded_transaction() -> sa.TextClause:
    """Terminate server process :pid if it still runs transaction :xid (its client lost
    the connection before COMMIT was sent or answered, and the server has not noticed):
    the transaction then aborts, so its fate is known. A role may end its own sessions."""
    return sa.text(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
        " WHERE pid = :pid AND backend_xid IS NOT NULL AND backend_xid::text = :xid32"
    )
