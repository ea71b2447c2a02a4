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

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from celery_lease.db.statements import attempt, cancel, dashboard, maintenance
from celery_lease.status import Event, Status

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
    #: A statement that moves its rows to different statuses: each row's event (else ``event``).
    event_of: Callable[[Row], Event] | None = None

    def event_for(self, row: Row) -> Event | None:
        return self.event if self.event_of is None else self.event_of(row)


def _requeued(row: Row, params: Mapping[str, Any]) -> bool:
    return row["status"] == _PENDING


def _retried(row: Row, params: Mapping[str, Any]) -> str:
    why = params.get("why")
    return f"in {params['delay']:.1f}s" if why is None else f"{why}; in {params['delay']:.1f}s"


#: Background writes never wait long on a row lock: a job's own success transaction
#: may hold it, and the worker's timeouts and revokes must not queue behind it.
BACKGROUND_LOCK_TIMEOUT = 2.0

SUCCEED = Transition("succeed", lambda dialect: attempt.complete_job(), Event.SUCCEEDED, fenced=True)
FAIL = Transition(
    "fail",
    lambda dialect: attempt.fail_job(),
    Event.FAILED,
    detail=lambda r, p: p["new_error"],
    fenced=True,
    ends=frozenset({_FAILED}),
)
RETRY = Transition("retry", lambda dialect: attempt.retry_job(), Event.RETRIED, detail=_retried, fenced=True)


def many(attempts: list[dict[str, Any]], **params: Any) -> dict[str, Any]:
    """The parameters of a statement of many attempts (TIME_OUT, complete_jobs): one
    dict per attempt, sent as one value, so the statement is the same for any number."""
    return {**attempt.attempt_params(attempts), **params}


def _timed_out(row: Row, params: Mapping[str, Any]) -> str:
    if row["status"] == _FAILED:
        return params["new_error"]
    (delay,) = (a["delay"] for a in params[attempt.ROWS] if a["id"] == str(row["id"]))
    return f"timed out; in {delay:.1f}s"


#: Every attempt of a worker process past its kind's timeout, in one statement: each row
#: fenced by its attempt's generation, retried (attempts left) or failed; written off the
#: heartbeat thread (worker/timeouts.py), so it never waits long on a job's own row lock.
#: Parameters: many(attempts: id, generation, delay; new_error=).
TIME_OUT = Transition(
    "time out",
    lambda dialect: attempt.time_out_jobs(dialect),
    Event.RETRIED,
    detail=_timed_out,
    ends=frozenset({_FAILED}),
    lock_timeout=BACKGROUND_LOCK_TIMEOUT,
    event_of=lambda r: Event.FAILED if r["status"] == _FAILED else Event.RETRIED,
)
SNOOZE = Transition(
    "snooze",
    lambda dialect: attempt.snooze_job(),
    Event.REQUEUED,
    detail=lambda r, p: f"snoozed for {p['delay']:g}s",
    fenced=True,
    wakes=lambda r, p: p["delay"] <= 0,
)
HAND_OFF = Transition(
    "hand off",
    lambda dialect: attempt.hand_off_job(),
    Event.REQUEUED,
    detail=lambda r, p: p.get("why") or "shutdown handoff",
    fenced=True,
    wakes=_requeued,
)
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
ALL = (SUCCEED, FAIL, RETRY, TIME_OUT, SNOOZE, HAND_OFF, CANCEL, REVOKE, REAP, RECOVER, RETRY_AS_NEW, DELETE)
