"""A transaction whose lost reply is settled by asking the server, never by guessing.

When the connection drops while COMMIT is on its way (or its answer is), the client
cannot tell whether the transaction committed. Re-running it is wrong both ways: if it
had committed, the retry matches nothing (the job already moved) and whatever the first
try set off after its commit (errbacks, a chord's count-down, a slot's release, wakeups,
cancel notices) is never done; if it had not, the retry is right.

So a :class:`Landing` takes the transaction's id and server process before COMMIT
(landing.transaction_mark, in the transaction's first round trip) and keeps what the
transaction's work returned. After a dropped connection it asks the server
(landing.transaction_status): committed -> that first try's value is the result, and
nothing runs again; aborted -> the work runs again; still in progress (the server has
not noticed its client is gone) -> that server process is ended
(landing.end_stranded_transaction), which aborts it, and the question asked again;
the server restarted since (a crash) -> the xid no longer names our transaction, so
the work runs again: every transition is guarded by the row's state (and an attempt's
by its fencing generation), so one that had committed matches nothing the second time
and is not applied twice (its follow-ups are then left to the sweepers: the price of
a crash inside a commit's window).
While the server cannot be asked, :meth:`Landing.run` raises DatabaseUnavailable and
keeps the question for its next call: a caller riding out a blip calls it again.

SQLite has no lost reply (a local file): an error there is a rollback.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from sqlalchemy import exc as sa_exc

from celery_lease.db.statements import landing
from celery_lease.errors import DatabaseUnavailable

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection, Engine

    from celery_lease.db.engine import Database

log = logging.getLogger("celery_lease")

T = TypeVar("T")

#: How often a try whose connection dropped before COMMIT is made again within one run().
TRIES = 3
#: Seconds to wait for a stranded transaction to end once its server process is told to.
STRANDED_WAIT = 5.0


@dataclass
class _Sent(Generic[T]):
    """A try whose COMMIT was sent: its transaction and what its work returned."""

    xid: str
    pid: int
    #: pg_postmaster_start_time() of the server that ran it (epoch seconds, as text).
    started: str
    value: T


class Landing(Generic[T]):
    """One transition's transaction, tried until it is known to have committed once.

    ``lock_timeout``: seconds any lock of the transaction may be waited for (PostgreSQL;
    None: the connection's setting). ``landed_earlier``: set when the value returned came
    from a try whose reply was lost.
    """

    def __init__(self, db: Database, engine: Engine, *, lock_timeout: float | None = None) -> None:
        self._db = db
        self._engine = engine
        self._lock_timeout = lock_timeout
        self._sent: _Sent[T] | None = None
        self.landed_earlier = False

    def run(self, work: Callable[[Connection], T]) -> T:
        """Run ``work`` in one transaction and commit, or return the value of an earlier
        try that is found committed. ``work`` must not act outside the transaction: its
        return value carries what the caller does after the commit."""
        earlier = self._sent
        if earlier is not None and self._settle(earlier):
            return self._landed(earlier)
        for attempt in range(1, TRIES + 1):
            try:
                return self._try(work)
            except sa_exc.DBAPIError as exc:
                sent = self._sent
                if not exc.connection_invalidated:
                    self._sent = None  # rolled back: the server answered with an error
                    raise self._db.translate(exc) from None
                log.warning("celery-lease: database connection dropped during a transition (%d)", attempt)
                if sent is not None and self._settle(sent):
                    return self._landed(sent)
                if attempt < TRIES:
                    time.sleep(0.05 * attempt)
        raise DatabaseUnavailable(f"cannot reach the job database {self._db.display_url} ({self._db.source})")

    def _try(self, work: Callable[[Connection], T]) -> T:
        postgres = self._db.dialect == "postgresql"
        with self._engine.begin() as conn:
            mark = None
            if postgres:
                params: dict[str, Any] = {}
                if self._lock_timeout is not None:
                    params["lock_timeout_ms"] = int(self._lock_timeout * 1000)
                mark = conn.execute(landing.transaction_mark(self._lock_timeout is not None), params).one()
            value = work(conn)
            # COMMIT is sent when the block exits: from here its outcome may be unknown.
            if mark is not None:
                self._sent = _Sent(str(mark[0]), int(mark[1]), str(mark[2]), value)
        self._sent = None
        return value

    def _landed(self, sent: _Sent[T]) -> T:
        self._sent = None
        self.landed_earlier = True
        log.warning("celery-lease: a transition had committed before its reply was lost; not run again")
        return sent.value

    def _settle(self, sent: _Sent[T]) -> bool:
        """Whether ``sent`` committed; raises DatabaseUnavailable (keeping the question)
        while the server cannot be asked."""
        deadline = time.monotonic() + STRANDED_WAIT
        ended = False
        while True:
            status = self._db.transaction(
                self._db.engine(single=True),
                lambda c: c.execute(landing.transaction_status(), {"xid": sent.xid, "started": sent.started}).scalar(),
            )
            if status == "restarted":
                log.warning("celery-lease: the database restarted before a transition's reply; running it again, fenced")
            if status != "in progress":
                self._sent = None
                return status == "committed"
            if not ended:
                xid32 = str(int(sent.xid) % 2**32)
                self._db.transaction(
                    self._db.engine(single=True),
                    lambda c: c.execute(landing.end_stranded_transaction(), {"pid": sent.pid, "xid32": xid32}),
                )
                ended = True
            if time.monotonic() >= deadline:
                raise DatabaseUnavailable("a transaction of the job database is still in progress after its connection dropped")
            time.sleep(0.05)
