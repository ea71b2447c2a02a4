"""The one function that changes a job's state: :meth:`Pipeline.execute` (the claims
have their sibling, lifecycle.claim).

For any :class:`~celery_lease.lifecycle.transition.Transition`, one transaction runs its
statement (fenced by the attempt's generation: zero rows -> LeaseLost, nothing below
runs), the run events of the rows it moved, the caller's own writes (a success's
effects, children, chain steps), and the errbacks and chord removal of the rows that
ended their job. It commits durably through a :class:`Landing` (a lost reply is asked
of the server, never guessed); an attempt's write is tried again through an outage
until its lease lapses, any other for a few seconds. Then, once, its follow-ups:
wakeups, plain errbacks and callbacks, cancel notices, slot releases.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from celery_lease.db import durability
from celery_lease.db.landing import Landing
from celery_lease.db.outage import retry_briefly, retry_within_lease
from celery_lease.db.statements.events import logs_itself
from celery_lease.errors import LeaseLost
from celery_lease.lifecycle.transition import CANCEL

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

    from celery_lease.db.store import Store
    from celery_lease.job import Job
    from celery_lease.lifecycle.transition import Transition

log = logging.getLogger("celery_lease")

T = TypeVar("T")

# What the pipeline needs of the layers above it, named here so it imports none of them:
# the worker's attempt, the producer, the canvas and flow control.


class Fenced(Protocol):
    """An attempt whose writes are fenced by its generation (worker/attempt.py)."""

    job_id: str

    @property
    def fence(self) -> dict[str, Any]: ...

    @property
    def is_lost(self) -> bool: ...

    @property
    def known_lost(self) -> bool: ...

    def mark_lost(self) -> None: ...

    def retry_within_lease(self, write: Callable[[], T], on_retry: Callable[[], None] | None = None) -> T: ...


class Wakes(Protocol):
    """Publishes the wakeups of due jobs (producer.py)."""

    def publish_wakeups(self, jobs: Sequence[Any], *, coalesce: bool = False) -> int: ...


class Endings(Protocol):
    """What jobs that ended set off: ``write`` in the transaction, ``send`` after it."""

    def write(self, conn: Connection, rows: Sequence[Any]) -> None: ...

    def send(self) -> None: ...


class Canvas(Protocol):
    """The errbacks, callbacks and chords of ended jobs (canvas.py)."""

    def endings(self, error: str, *, run_cancelled: bool = False, eager: bool = False) -> Endings: ...

    def send_outbox(self, rows: Sequence[Mapping[str, Any]]) -> int: ...


class Releases(Protocol):
    """Frees the slots of limited kinds' jobs that stopped running (flow/control.py)."""

    def release(self, rows: Iterable[Mapping[str, Any]]) -> int: ...


class During(Protocol):
    """A caller's own part of a transition: ``write`` inside its transaction, after the
    statement matched (returns the jobs it created, to be woken); ``send`` after the
    commit, once."""

    def write(self, conn: Connection, rows: Sequence[Mapping[str, Any]]) -> list[Job]: ...

    def send(self) -> None: ...


class Pipeline:
    def __init__(
        self,
        store: Store,
        producer: Wakes,
        *,
        canvas: Canvas | None = None,
        flow: Releases | None = None,
        notify: Callable[[list[str]], None] | None = None,
        eager: bool = False,
    ) -> None:
        self._store = store
        self._producer = producer
        self._canvas = canvas
        #: Frees the slots of limited kinds' jobs (None: eager mode, no limits).
        self._flow = flow
        #: Tells workers that jobs they hold were cancelled (cancel_notice).
        self._notify = notify
        self._eager = eager

    def execute(
        self,
        t: Transition,
        params: Mapping[str, Any] | None = None,
        *,
        attempt: Fenced | None = None,
        attempts: Sequence[Fenced] = (),
        build: Mapping[str, Any] | None = None,
        before: Callable[[Connection], Any] | None = None,
        during: During | None = None,
        error: str | None = None,
        run_cancelled: bool = False,
    ) -> list[dict[str, Any]]:
        """Execute ``t``; return the rows it moved. ``attempt``: the attempt whose write
        this is (fenced transitions); ``attempts``: the attempts a statement that fences each
        of its rows itself writes at once (the completer's, the timeouts'), retried
        through a database outage while any of them lives (the caller decides about
        those whose row it did not move); ``build``: the statement's build arguments;
        ``before(conn)``: runs first in the transaction (a cancelled run is marked);
        ``error``: what errbacks get (default: the transition's). Raises LeaseLost when a
        fenced transition finds its lease lost (nothing done), DatabaseUnavailable when
        the database stays unreachable (nothing known to be done)."""
        store = self._store
        stmt = base = t.statement(store.dialect, **(build or {}))
        if t.durable:  # synchronous commit whatever the server's or the engine's default
            stmt = durability.durable(stmt)
        args = {**(attempt.fence if attempt is not None else {}), **(params or {})}
        endings: Endings | None = None
        if t.ends and self._canvas is not None:
            endings = self._canvas.endings(error or t.error or "", run_cancelled=run_cancelled, eager=self._eager)
        logged = logs_itself(stmt)
        # Of many attempts: given up once every one is lost (by its own clock, or only
        # once known, see Transition.outlives_lapse).
        gone = (lambda a: a.known_lost) if t.outlives_lapse else (lambda a: a.is_lost)

        def work(conn: Connection) -> tuple[list[dict[str, Any]], list[Job]]:
            if (attempt is not None and attempt.is_lost) or (attempts and all(gone(a) for a in attempts)):
                raise LeaseLost()
            if before is not None:
                before(conn)
            rows = store.rows_in(conn, stmt, args, key=base if t.prepared else None)
            if t.fenced and attempt is not None and not rows:
                attempt.mark_lost()
                raise LeaseLost()
            if rows and not logged:
                events = ((r, t.event_for(r, args)) for r in rows)
                store.log_events(conn, [(r, e, t.detail(r, args)) for r, e in events if e is not None])
            created = during.write(conn, rows) if during is not None else []
            if endings is not None:
                endings.write(conn, [r for r in rows if r["status"] in t.ends])
            return rows, created

        landing: Landing[tuple[list[dict[str, Any]], list[Job]]] = Landing(
            store, store.durable if t.durable else store.fast, lock_timeout=t.lock_timeout
        )
        try:
            if attempt is not None:
                rows, created = attempt.retry_within_lease(lambda: landing.run(work))
            elif attempts:  # tried again while any of its attempts lives (each by its own clock)
                rows, created = retry_within_lease(
                    lambda: landing.run(work),
                    lambda: all(gone(a) for a in attempts),
                    what=f"{t.name} of {len(attempts)} attempts",
                )
            else:
                rows, created = retry_briefly(lambda: landing.run(work))
        except LeaseLost:
            # Given up (the lease lapsed by its own clock) with a commit's fate unknown:
            # asked once more, a commit that landed is not reported discarded. Unasked,
            # what it set off still goes out: the outbox and the sweepers.
            landed = landing.settle_now()
            if landed is None:
                if landing.unsettled:  # the server still cannot be asked
                    log.warning(
                        "celery-lease: %s: given up with its commit unknown; if it landed, its follow-ups still go out", t.name
                    )
                raise
            rows, created = landed
        self._after(t, args, rows, created, endings, during, attempt)
        return rows

    def _after(
        self,
        t: Transition,
        args: Mapping[str, Any],
        rows: list[dict[str, Any]],
        created: list[Job],
        endings: Endings | None,
        during: During | None,
        attempt: Fenced | None,
    ) -> None:
        """The follow-ups of one committed transition; each is best-effort (the commit
        stands: the sweeper re-sends a lost wakeup, a held job's slot is recovered by
        flow control's sweep) and none is skipped because another failed."""
        steps: list[tuple[str, Callable[[], Any]]] = [
            ("wakeups", lambda: self._producer.publish_wakeups([*created, *(r for r in rows if t.wakes(r, args))])),
        ]
        if during is not None:
            steps.append(("callbacks", during.send))
        if endings is not None:
            steps.append(("errbacks", endings.send))
        if t.notifies and rows and self._notify is not None:
            steps.append(("cancel notices", lambda: self._notify([str(r["id"]) for r in rows])))  # type: ignore[misc]
        if t.releases and self._flow is not None:
            steps.append(("slot release", lambda: self._release(rows)))
        for what, step in steps:
            try:
                step()
            except Exception:
                log.exception("celery-lease: %s after %s of %d job(s) failed", what, t.name, len(rows))

    def claim_cancelled(self, row: Mapping[str, Any]) -> None:
        """The follow-up of a claim that found its job's run cancelled and cancelled it
        (lifecycle/claim.py): what a cancel sets off follows, once: its errbacks fire,
        a chord it heads is removed (through a Landing: a lost reply is settled, not
        written twice). It took no slot: nothing to release. Never raises."""
        if self._canvas is None or not row.get("canvas"):
            return
        endings = self._canvas.endings(CANCEL.error or "", run_cancelled=True, eager=self._eager)
        store = self._store
        landing: Landing[None] = Landing(store, store.durable)
        try:
            retry_briefly(lambda: landing.run(lambda conn: endings.write(conn, [row])))
            endings.send()
        except Exception:
            # Never fails the delivery; the job is cancelled whatever happens here.
            log.exception("celery-lease: job %s: the errbacks of its cancel at claim could not be sent", row["id"])

    def send_outbox(self, rows: Sequence[Mapping[str, Any]]) -> int:
        """Send the follow-ups ``rows`` of the outbox hold (the sweeper's: their
        transitions committed and nobody sent them); returns how many went out."""
        return self._canvas.send_outbox(rows) if self._canvas is not None else 0

    def _release(self, rows: list[dict[str, Any]]) -> None:
        assert self._flow is not None
        self._flow.release(rows)  # the rows carry kind, concurrency_key (and limited)
