"""Every way a job leaves ``running`` or ``pending``, named once (the claims, which enter
``running``: :mod:`celery_lease.lifecycle.claim`).

A :class:`Transition` is a value: its statement (from the catalogue), the run event it
logs per row, its durability, and the follow-ups its rows set off after the commit,
exactly once: ``ends`` (errbacks, a chord removed), ``wakes`` (a wakeup for rows left
pending), ``releases`` (flow-control slots), ``notifies`` (cancel notices).
:class:`~celery_lease.lifecycle.pipeline.Pipeline` executes any of them the same way, so
no call site chooses a commit mode, forgets an errback or frees a slot twice. Each one
here ends an attempt or bumps a generation, so each commits durably in every mode (a
fast commit lost in a crash after its follow-ups went out would undo them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from celery_lease.db.statements import attempt, cancel, dashboard, maintenance
from celery_lease.status import AttemptOutcome, Event, Status

Row = Mapping[str, Any]

_FAILED, _CANCELLED, _EXPIRED = Status.FAILED.value, Status.CANCELLED.value, Status.EXPIRED.value
_PENDING = Status.PENDING.value


@dataclass(frozen=True)
class Transition:
    #: Its name in logs and docs (docs/lifecycle.md).
    name: str
    #: Builds the statement: ``statement(dialect, **build)`` (Pipeline.execute's ``build``).
    statement: Callable[..., Any]
    #: The run event logged for each row it moves (jobs of a run only); None: none (a
    #: delete: the job's events go with it).
    event: Event | None
    #: The event's detail for a row, given the statement's parameters.
    detail: Callable[[Row, Mapping[str, Any]], str | None] = lambda row, params: None
    #: One attempt's write, guarded by its lease generation: zero rows = the lease is
    #: lost, the transaction rolls back and nothing follows.
    fenced: bool = False
    #: Commits with synchronous_commit on. Every transition here does (see above).
    durable: bool = True
    #: Rows reaching these statuses end their job otherwise than by success.
    ends: frozenset[str] = frozenset()
    #: Whether a row was left pending and marked woken: its wakeup is published.
    wakes: Callable[[Row, Mapping[str, Any]], bool] = lambda row, params: False
    releases: bool = True
    notifies: bool = False
    #: Seconds a row lock may be waited for (transitions run off a request path: the
    #: worker's timeouts and revokes, maintenance); None: the connection's setting.
    lock_timeout: float | None = None
    #: The error errbacks get, when the caller gives none.
    error: str | None = None
    #: Sent prepared where the store prepares statements (one statement, cached by the
    #: catalogue, for any parameters: a plan kept per connection).
    prepared: bool = False
    #: Its write of many attempts (``attempts=``) is tried through an outage until each
    #: lease is known lost, not only lapsed by its attempt's own clock: a body that
    #: finished is still recorded (fenced: a job the reaper took is not written).
    outlives_lapse: bool = False
    #: A statement that moves its rows to different statuses: each row's event (else ``event``).
    event_of: Callable[[Row, Mapping[str, Any]], Event] | None = None

    def event_for(self, row: Row, params: Mapping[str, Any]) -> Event | None:
        return self.event if self.event_of is None else self.event_of(row, params)


def _requeued(row: Row, params: Mapping[str, Any]) -> bool:
    return row["status"] == _PENDING


#: Background writes never wait long on a row lock: a job's own success transaction
#: may hold it, and the worker's timeouts and revokes must not queue behind it.
BACKGROUND_LOCK_TIMEOUT = 2.0


@dataclass(frozen=True)
class Ending:
    """How one attempt ends: a row of the one ending statement (end_jobs), written for
    it alone or with any others (River's JobSetStateIfRunningParams). Build it with
    the constructors below, one per outcome."""

    job_id: str
    generation: int
    outcome: AttemptOutcome
    result: Any = None
    #: The last ctx.publish() value still unwritten, if any (a success's).
    progress: Any = None
    #: The stored error of a failure (or of a timeout on the last attempt).
    error: str | None = None
    #: Seconds until a retry, a snooze or a timeout's retry is due.
    delay: float = 0.0
    #: The run event's detail, when the job does not end failed (its error then).
    detail: str | None = None

    @classmethod
    def succeeded(cls, a: Claimed, result: Any, progress: Any = None) -> Ending:
        return cls(*_key(a), AttemptOutcome.SUCCEEDED, result=result, progress=progress)

    @classmethod
    def failed(cls, a: Claimed, error: str) -> Ending:
        return cls(*_key(a), AttemptOutcome.FAILED, error=error)

    @classmethod
    def retried(cls, a: Claimed, delay: float, why: str | None = None) -> Ending:
        detail = f"in {delay:.1f}s" if why is None else f"{why}; in {delay:.1f}s"
        return cls(*_key(a), AttemptOutcome.RETRIED, delay=delay, detail=detail)

    @classmethod
    def timed_out(cls, a: Claimed, delay: float, error: str) -> Ending:
        """Retried after ``delay``, or failed with ``error`` on its last attempt (the
        statement decides, from the row)."""
        return cls(*_key(a), AttemptOutcome.TIMED_OUT, error=error, delay=delay, detail=f"timed out; in {delay:.1f}s")

    @classmethod
    def snoozed(cls, a: Claimed, seconds: float) -> Ending:
        return cls(*_key(a), AttemptOutcome.SNOOZED, delay=seconds, detail=f"snoozed for {seconds:g}s")

    @classmethod
    def handed_off(cls, a: Claimed, why: str | None = None) -> Ending:
        return cls(*_key(a), AttemptOutcome.HANDED_OFF, detail=why or "shutdown handoff")

    def row(self) -> dict[str, Any]:
        return {
            "id": self.job_id,
            "generation": self.generation,
            "outcome": self.outcome.value,
            "result": self.result,
            "progress": self.progress,
            "error": self.error,
            "delay": self.delay,
            "detail": self.detail,
        }


class Claimed(Protocol):
    """An attempt, as its ending names it (worker/attempt.py)."""

    job_id: str
    generation: int


def _key(a: Claimed) -> tuple[str, int]:
    return a.job_id, a.generation


def ending_params(endings: Sequence[Ending]) -> dict[str, Any]:
    """The parameters of END for these endings: one array per column, the same
    statement for any number of them."""
    return attempt.attempt_params([e.row() for e in endings])


def _row_ending(row: Row, params: Mapping[str, Any]) -> Mapping[str, Any]:
    (ending,) = (e for e in params[attempt.ROWS] if e["id"] == str(row["id"]))
    return ending


def _ended_event(row: Row, params: Mapping[str, Any]) -> Event:
    if row["status"] == Status.SUCCEEDED.value:
        return Event.SUCCEEDED
    if row["status"] == _FAILED:
        return Event.FAILED
    outcome = _row_ending(row, params)["outcome"]
    return Event.REQUEUED if outcome in (AttemptOutcome.SNOOZED.value, AttemptOutcome.HANDED_OFF.value) else Event.RETRIED


def _ended_detail(row: Row, params: Mapping[str, Any]) -> str | None:
    return row["error"] if row["status"] == _FAILED else _row_ending(row, params)["detail"]


#: Every end of an attempt, whatever its outcome (Ending), one or many in one statement:
#: each row fenced by its attempt's generation; failures fire their errbacks, a hand-off
#: and a snooze due now are woken. Parameters: ending_params(endings). One attempt's
#: (``attempt=``) raises LeaseLost when its lease is lost; of many (``attempts=``, the
#: completer's), the caller decides about those missing from the rows.
END = Transition(
    "end",
    lambda dialect: attempt.end_jobs(dialect),
    None,
    detail=_ended_detail,
    fenced=True,
    ends=frozenset({_FAILED}),
    wakes=lambda r, p: r["status"] == _PENDING and r["woken_at"] is not None,
    event_of=_ended_event,
    prepared=True,
    outlives_lapse=True,
)
#: END off the worker's heartbeat thread (its timeouts: worker/timeouts.py), which must
#: never wait long on a job's own row lock.
END_IN_BACKGROUND = dataclasses.replace(END, name="end (background)", lock_timeout=BACKGROUND_LOCK_TIMEOUT, outlives_lapse=False)
CANCEL = Transition(
    "cancel",
    lambda dialect, **which: cancel.cancel_jobs(**which),
    Event.CANCELLED,
    ends=frozenset({_CANCELLED}),
    notifies=True,
    error="cancelled",
)
#: A revoke broadcast's ids, cancelled off the worker's consumer (worker/revoke.py).
REVOKE = Transition(
    "revoke",
    lambda dialect, **which: cancel.cancel_jobs(**which),
    Event.CANCELLED,
    ends=frozenset({_CANCELLED}),
    notifies=True,
    error="cancelled",
    lock_timeout=BACKGROUND_LOCK_TIMEOUT,
)
REAP = Transition(
    "reap",
    maintenance.reap,
    Event.REAPED,
    detail=lambda r, p: f"{maintenance.LEASE_EXPIRED}: {r['status']}",
    ends=frozenset({_EXPIRED}),
    wakes=_requeued,
    error=maintenance.LEASE_EXPIRED,
    lock_timeout=BACKGROUND_LOCK_TIMEOUT,
)
RECOVER = Transition(
    "restart recovery",
    lambda dialect, **owner: maintenance.recover_restarted(**owner),
    Event.REQUEUED,
    detail=lambda r, p: f"interrupted by restart: {r['status']}",
    ends=frozenset({_FAILED}),
    wakes=_requeued,
    error="interrupted by restart",
)

#: An operator's retry of an ended job (the dashboard, the API, the CLI: ops/retry.py):
#: not a transition of that job (a terminal job never changes) but the submit of a new
#: one, its copy with the old job as parent, named here so it runs like any write:
#: durable, its dispatched event, its wakeup after the commit. Build with ``tenant``;
#: parameters: new_id (ops.retry.retry_id(job_id): a job is retried once), job_id.
RETRY_AS_NEW = Transition(
    "retry as new job",
    lambda dialect, tenant: dashboard.retry_as_new_job(tenant, dialect),
    Event.DISPATCHED,
    detail=lambda r, p: f"retry of {p['job_id']}",
    wakes=lambda r, p: True,
    releases=False,
)
#: An operator's delete of ended jobs (the dashboard): only terminal ones (a pending or
#: running job is cancelled first: its worker or wakeup would find no row). Their run
#: events are deleted in the same transaction (the caller's ``during``). Build with
#: ``ids`` and ``tenant``.
DELETE = Transition(
    "delete",
    lambda dialect, ids, tenant: dashboard.delete_finished_jobs(ids, tenant, dialect),
    None,
    releases=False,
)

#: Every transition, for docs/lifecycle.md and the tests that hold them to the rules above.
ALL = (END, END_IN_BACKGROUND, CANCEL, REVOKE, REAP, RECOVER, RETRY_AS_NEW, DELETE)
