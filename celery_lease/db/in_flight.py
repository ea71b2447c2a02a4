"""What a dropped connection may still be doing on the server, waited for before a retry.

A backend notices that its client is gone only when it next reads or writes, so a
statement still in flight when the connection dropped (waiting for a lock, or its commit
waiting in ``commit_delay``) can commit after the client gave it up. The rule: a retry,
and the caller's look at what landed (``on_retry``: a claim's adoption by its token, a
success read back by its generation), must see that outcome, not race it. A Landing
transaction (db/landing.py) needs no wait: its marker row's unique index makes the
retry's own insert wait for the first try's outcome.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Engine

log = logging.getLogger("celery_lease")

#: Seconds a retry waits at most for the dropped connection's backend.
IN_FLIGHT_WAIT = 10.0
#: Whether a backend still runs a statement or holds a transaction open.
_IN_FLIGHT = sa.text(
    "SELECT 1 FROM pg_stat_activity WHERE pid = :pid"
    " AND state IN ('active', 'idle in transaction', 'idle in transaction (aborted)')"
)


def backend_pid(dbapi_connection: Any) -> int | None:
    """The server process of a driver connection (psycopg2: no round trip), else None."""
    get = getattr(dbapi_connection, "get_backend_pid", None)
    return get() if get is not None else None


def await_in_flight(engine: Engine, pid: int | None) -> None:
    """Wait, at most IN_FLIGHT_WAIT, until backend ``pid`` (the dropped connection's)
    no longer runs a statement or holds a transaction. None (not PostgreSQL, or no
    connection was made) waits for nothing, as does a pid the server does not know
    (PgBouncer hands out its own); a server that cannot be reached either is left to
    the retry."""
    if pid is None:
        return
    deadline = time.monotonic() + IN_FLIGHT_WAIT
    while True:
        try:
            with engine.connect() as conn:
                if conn.execute(_IN_FLIGHT, {"pid": pid}).first() is None:
                    return
        except sa_exc.DBAPIError:
            return
        if time.monotonic() >= deadline:
            log.warning("celery-lease: a statement of a dropped connection still runs after %.0fs; retrying", IN_FLIGHT_WAIT)
            return
        time.sleep(0.02)
