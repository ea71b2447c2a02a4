"""A transaction's fate after a lost reply (celery_lease/db/landing.py). PostgreSQL only:
SQLite has no lost reply."""

from __future__ import annotations

import functools

import sqlalchemy as sa


@functools.cache
def transaction_mark(lock_timeout: bool) -> sa.TextClause:
    """Insert the transaction's marker row under the client's :token, and return its
    server process and id (an xid8, as text) so a transaction left in progress by a lost
    client can be ended; with ``lock_timeout``, also ``SET LOCAL lock_timeout =
    :lock_timeout_ms``. One round trip, the transaction's first. The token (a fresh UUID)
    never conflicts, so the insert waits on nothing."""
    returning = "pg_backend_pid(), CAST(pg_current_xact_id() AS text)"
    if lock_timeout:
        returning += ", set_config('lock_timeout', CAST(:lock_timeout_ms AS text), true)"
    return sa.text(f"INSERT INTO celery_lease_landings (token, created_at) VALUES (:token, now()) RETURNING {returning}")


@functools.cache
def settle_mark() -> sa.TextClause:
    """Whether the transaction that inserted :token committed, asked by inserting the
    same token: a row back means the token was free (it aborted, or a crash forgot it),
    and it now never can commit; no row means it committed. A transaction still in
    progress holds the key: the insert waits for it to end (bounded by the lock timeout
    the caller sets).

    Why not pg_xact_status(xid): a backend killed by a signal (the OOM killer, a
    segfault) makes the postmaster reset every backend and replay the WAL without a
    restart; an xid whose WAL never reached the disk is forgotten and handed out again,
    so the server answers "transaction ID is in the future" (SQLSTATE 22023), or for
    whichever transaction took that xid since ('committed'). A marker row cannot be
    forgotten without its transaction: a page never reaches the disk before its WAL."""
    return sa.text(
        "INSERT INTO celery_lease_landings (token, created_at) VALUES (:token, now())"
        " ON CONFLICT (token) DO NOTHING RETURNING token"
    )


@functools.cache
def settle_wait(ms: int) -> sa.TextClause:
    """SET LOCAL lock_timeout for the question (settle_mark): how long it waits for a
    transaction still in progress before its server process is ended."""
    return sa.text(f"SET LOCAL lock_timeout = {int(ms)}")


@functools.cache
def end_stranded_transaction() -> sa.TextClause:
    """Terminate server process :pid if it still runs transaction :xid (its client lost
    the connection before COMMIT was sent or answered, and the server has not noticed):
    the transaction then aborts, so its fate is known. A role may end its own sessions."""
    return sa.text(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
        " WHERE pid = :pid AND backend_xid IS NOT NULL AND backend_xid::text = :xid32"
    )


@functools.cache
def prune_marks() -> sa.TextClause:
    """Delete marker rows older than :cutoff_seconds (at most :limit; several beats skip
    each other's); returns how many."""
    return sa.text(
        "WITH old AS (SELECT token FROM celery_lease_landings WHERE created_at < now() - make_interval(secs => :cutoff_seconds)"
        " LIMIT :limit FOR UPDATE SKIP LOCKED)"
        " DELETE FROM celery_lease_landings l USING old WHERE l.token = old.token"
    )
