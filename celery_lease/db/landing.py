"""A transaction whose lost reply is settled by what it wrote, never by guessing
(docs/lifecycle.md, "A lost reply is settled ...").

When the connection drops while COMMIT (or its answer) is on its way, the client cannot
tell whether the transaction committed. So a :class:`Landing` transaction first inserts a
marker row under a token the client made (landing.transaction_mark); after a dropped
connection it inserts the same token again (landing.settle_mark): taken -> committed, the
first try's value is the result; free -> aborted, the work runs again under a new token;
held by a transaction still in progress -> that server process is ended and the question
asked again. The rule: a commit is taken from nothing but its own row, never an xid.
While the server cannot be asked, :meth:`Landing.run` raises DatabaseUnavailable and keeps
the question for its next call. SQLite has no lost reply: an error there is a rollback.
"""

from __future__ import annotations

import logging
import time
import uuid
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

#: SQLSTATE of a lock wait that exceeded lock_timeout.
LOCK_NOT_AVAILABLE = "55P03"

T = TypeVar("T")

#: How often a try whose connection dropped before COMMIT is made again within one run().
TRIES = 3
#: Seconds to wait for a stranded transaction to end once its server process is told to.
STRANDED_WAIT = 5.0
#: Milliseconds one question waits for a transaction still in progress (then its server
#: process is ended, and the question asked again).
QUESTION_WAIT_MS = 200
#: Seconds a marker row is kept (the pruner's bound): longer than any question is kept.
LANDING_RETENTION = 3600.0


@dataclass
class _Sent(Generic[T]):
    """A try whose COMMIT was sent: its transaction and what its work returned."""

    #: The marker row's key: the question after a lost reply.
    token: str
    #: Its server process and transaction id: to end it if it is still in progress.
    pid: int
    xid: str
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

    @property
    def unsettled(self) -> bool:
        """Whether a try's reply was lost and its fate is not known yet."""
        return self._sent is not None

    def settle_now(self) -> T | None:
        """The value of the try whose reply was lost, if it is found committed now; None
        when no question is kept, the try did not commit, or the server still cannot be
        asked. For a caller about to give up (an attempt whose lease lapsed while the
        server was away): a commit that landed is then not reported as discarded."""
        sent = self._sent
        if sent is None:
            return None
        try:
            return self._landed(sent) if self._settle(sent) else None
        except DatabaseUnavailable:
            return None

    def _try(self, work: Callable[[Connection], T]) -> T:
        postgres = self._db.dialect == "postgresql"
        with self._engine.begin() as conn:
            mark = None
            token = str(uuid.uuid4())
            if postgres:
                params: dict[str, Any] = {"token": token}
                if self._lock_timeout is not None:
                    params["lock_timeout_ms"] = int(self._lock_timeout * 1000)
                mark = conn.execute(landing.transaction_mark(self._lock_timeout is not None), params).one()
            value = work(conn)
            # COMMIT is sent when the block exits: from here its outcome may be unknown.
            if mark is not None:
                self._sent = _Sent(token, int(mark[0]), str(mark[1]), value)
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
            committed = self._ask(sent.token)
            if committed is not None:
                self._sent = None
                return committed
            if not ended:
                xid32 = str(int(sent.xid) % 2**32)
                self._db.transaction(
                    self._db.engine(single=True),
                    lambda c: c.execute(landing.end_stranded_transaction(), {"pid": sent.pid, "xid32": xid32}),
                )
                ended = True
            if time.monotonic() >= deadline:
                raise DatabaseUnavailable("a transaction of the job database is still in progress after its connection dropped")

    def _ask(self, token: str) -> bool | None:
        """Whether the transaction that inserted ``token`` committed; None while it is
        still in progress (the question waited QUESTION_WAIT_MS on its key)."""
        for attempt in range(1, TRIES + 1):
            try:
                with self._db.engine(single=True).begin() as conn:
                    conn.execute(landing.settle_wait(QUESTION_WAIT_MS))
                    return conn.execute(landing.settle_mark(), {"token": token}).first() is None
            except sa_exc.DBAPIError as exc:
                if getattr(exc.orig, "pgcode", None) == LOCK_NOT_AVAILABLE:
                    return None
                if not exc.connection_invalidated or attempt == TRIES:
                    raise self._db.translate(exc) from None
                time.sleep(0.05 * attempt)  # the pool's other connections died with this one
        raise AssertionError("unreachable")
