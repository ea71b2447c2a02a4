"""Celery's canvas on leased tasks: chain, group, chord, link and link_error, with the
hand-offs made durable where Celery's are not (docs/coming-from-celery.md).

A leased step's job id is its frozen task id (idempotency key ``celery:<task id>``
unless the caller gave one, so applying the same frozen step twice creates one job).
What a step still has to do after it ends is stored in its row (the ``canvas`` column),
never in the wakeup. The rule: a leased follow-up (next chain step, errback, chord body)
is created in the transaction of the transition that sets it off, so exactly once; a
plain one is applied after that commit, under Celery's guarantee. Chords need
celery-lease's result backend and all-leased headers; ``priority=`` is kept in the row.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from celery import Celery
from celery.canvas import Signature, signature
from kombu.utils import json as kombu_json

from celery_lease.db.statements.outbox import KIND_CELERY
from celery_lease.job import parse_job_id
from celery_lease.kinds import JobKind, Registry
from celery_lease.status import Event

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

    from celery_lease.db.store import Store
    from celery_lease.job import Job
    from celery_lease.producer import Producer

log = logging.getLogger("celery_lease")

#: Celery's canvas options a leased job keeps in its row.
STORED_OPTIONS = ("chain", "link", "link_error", "root_id", "parent_id", "group_id", "group_index", "priority", "argsrepr")


def to_json(value: Any) -> Any:
    """Signatures (with datetimes, nested signatures...) as plain JSON for the row."""
    return json.loads(kombu_json.dumps(value))


def from_json(value: Any) -> Any:
    return kombu_json.loads(json.dumps(value))


class Source(Protocol):
    """The job whose outcome sets a canvas off: an Attempt, or an :class:`Origin`."""

    @property
    def job_id(self) -> str: ...
    @property
    def run_id(self) -> str | None: ...
    @property
    def tenant(self) -> str | None: ...
    @property
    def canvas(self) -> Any: ...


@dataclasses.dataclass(frozen=True)
class Origin:
    """A job that ended outside its attempt (cancelled, expired, recovered), from its row."""

    job_id: str
    run_id: str | None
    tenant: str | None
    canvas: Any

    @classmethod
    def of(cls, row: Any) -> Origin:
        run_id = row["run_id"]
        return cls(str(row["id"]), None if run_id is None else str(run_id), row["tenant"], row["canvas"])


def _as_list(value: Any) -> list:
    if value is None:
        return []
    if isinstance(value, (list, tuple)) and not isinstance(value, Signature):
        return list(value)
    return [value]


class Canvas:
    """The canvas of one CeleryLease's leased tasks, producer and worker side."""

    def __init__(self, app: Celery, registry: Registry, producer: Callable[[], Producer], store: Callable[[], Store]) -> None:
        self._app = app
        self._registry = registry
        self._producer = producer
        self._store = store

    # --- which signatures are ours ----------------------------------------------------

    def spec_of(self, sig: Any) -> JobKind | None:
        """The job kind of a plain signature of one of our leased tasks, else None
        (a plain task, a group, a chain, a chord)."""
        if not isinstance(sig, dict) or sig.get("subtask_type") or "task" not in sig:
            return None
        spec = getattr(self._app.tasks.get(sig["task"]), "spec", None)
        if isinstance(spec, JobKind) and spec.kind in self._registry.names() and self._registry.resolve(spec.kind) is spec:
            return spec
        return None

    @staticmethod
    def check_step(sig: Any, spec: JobKind, *, receives_result: bool) -> None:
        """A leased step takes exactly one payload: the previous result or its own."""
        args = tuple(sig.get("args") or ())
        kwargs = dict(sig.get("kwargs") or {})
        immutable = bool(sig.get("immutable"))
        count = len(args) + len(kwargs) + (1 if receives_result and not immutable else 0)
        if count != 1 or (kwargs and set(kwargs) != {"payload"}):
            raise TypeError(
                f"leased task {sig['task']} takes one payload: in a chain or callback use "
                f"{spec.kind}.s() to receive the previous result, or {spec.kind}.si(payload) to ignore it"
            )

    # --- producer side: what a submit stores --------------------------------------------

    def pack(self, options: dict[str, Any]) -> dict[str, Any] | None:
        """The row's canvas from Celery's apply_async options (which it consumes); checks
        every leased step ahead, so a bad chain stores nothing."""
        stored = {key: options.pop(key) for key in STORED_OPTIONS if options.get(key) not in (None, [], ())}
        chord = options.pop("chord", None)
        if chord is not None:
            stored["chord"] = stored.get("group_id")
            if not stored["chord"]:
                raise TypeError("a chord header job needs its group id (apply the chord, not its members)")
        for sig in _as_list(stored.get("chain")):
            spec = self.spec_of(sig)
            if spec is not None:
                self.check_step(sig, spec, receives_result=True)
        for key in ("link", "link_error"):
            if key in stored:
                stored[key] = _as_list(stored[key])
                for sig in stored[key]:
                    spec = self.spec_of(sig)
                    if spec is not None:
                        self.check_step(sig, spec, receives_result=True)
        return to_json(stored) if stored else None

    def create_chord(self, group_id: str, members: list[str], body: Any) -> None:
        try:  # the pruner reads the members as job ids: refuse any other before storing
            members = [parse_job_id(m) for m in members]
        except ValueError:
            raise TypeError("a chord header job's task id is its job id and must be a UUID") from None
        self._store().create_chord(group_id, members, to_json(body))

    # --- worker side: what an outcome sets off ------------------------------------------

    def after_success(self, attempt: Source, result: Any, *, eager: bool = False) -> FollowUp | None:
        canvas = from_json(attempt.canvas) if attempt.canvas else None
        if not canvas:
            return None
        follow = FollowUp(self, attempt, eager=eager)
        chain = _as_list(canvas.get("chain"))
        if chain:
            follow.next_step(signature(chain.pop(), app=self._app), (result,), chain, canvas)
        for callback in _as_list(canvas.get("link")):
            follow.next_step(signature(callback, app=self._app), (result,), [], canvas)
        if canvas.get("chord"):
            follow.chord_member = str(canvas["chord"])
        return follow

    def after_failure(self, attempt: Source, error: str, *, eager: bool = False) -> FollowUp | None:
        canvas = from_json(attempt.canvas) if attempt.canvas else None
        if not canvas:
            return None
        follow = FollowUp(self, attempt, eager=eager)
        for errback in _as_list(canvas.get("link_error")):
            follow.errback(signature(errback, app=self._app), error, canvas)
        if canvas.get("chord"):
            follow.chord_failed = str(canvas["chord"])
        return follow

    def endings(self, error: str, *, run_cancelled: bool = False, eager: bool = False) -> Endings:
        """For a transition that ends jobs otherwise than by success, with ``error``;
        ``run_cancelled``: the jobs' run was cancelled with them (see Endings)."""
        return Endings(self, error, run_cancelled=run_cancelled, eager=eager)

    def send_outbox(self, rows: Sequence[Mapping[str, Any]]) -> int:
        """Apply the plain signatures of outbox ``rows`` whose writer did not (the sweeper:
        its commit was not heard, or it died) and delete those sent; returns how many."""
        sent = []
        for row in rows:
            payload = from_json(row["payload"])
            if _apply(signature(payload["sig"], app=self._app), tuple(payload["args"]), payload["options"]):
                sent.append(str(row["id"]))
        _delete_sent(self._store(), sent)
        return len(sent)


class FollowUp:
    """The jobs and messages one job's outcome sets off.

    ``write(conn)`` runs inside the transaction that records the outcome (after its fenced
    update matched): it inserts the leased next steps, counts the chord down, and writes
    the plain ones to the outbox. ``send()`` runs after that commit is heard: it applies
    them and deletes their outbox rows; else (a lost reply, a crash) the sweeper does
    (:meth:`Canvas.send_outbox`). A plain one is applied at least once.
    """

    def __init__(self, canvas: Canvas, attempt: Source, *, eager: bool) -> None:
        self._canvas = canvas
        self._attempt = attempt
        self._eager = eager
        self.rows: list[dict[str, Any]] = []
        self.sends: list[tuple[Signature, tuple, dict[str, Any]]] = []
        self.chord_member: str | None = None
        self.chord_failed: str | None = None
        self._planned: tuple[list, list] | None = None  # write() starts each try from it
        self._outbox: list[str] = []  # the plain ones' rows (none when eager: applied at once)

    def _lineage(self, canvas: dict) -> dict[str, Any]:
        return {"root_id": canvas.get("root_id") or self._attempt.job_id, "parent_id": self._attempt.job_id}

    def _row(self, spec: JobKind, sig: Signature, payload: Any, extra: dict[str, Any]) -> dict[str, Any]:
        options = dict(sig.options)
        job_id = options.get("task_id") or str(uuid.uuid4())
        stored = {key: options[key] for key in STORED_OPTIONS if options.get(key) not in (None, [], ())}
        stored.update({k: v for k, v in extra.items() if v not in (None, [])})
        producer = self._canvas._producer()
        row_options = {
            "job_id": job_id,
            "idempotency_key": f"celery:{job_id}",
            "queue": options.get("queue"),
            "run_id": self._attempt.run_id,
            "tenant": self._attempt.tenant,
            "parent_id": self._attempt.job_id,
            "canvas": to_json(stored) if stored else None,
        }
        return producer.job_row(spec, producer.serialize(spec, payload), row_options)

    def next_step(self, sig: Signature, args: tuple, rest: list, canvas: dict) -> None:
        spec = self._canvas.spec_of(sig)
        if spec is None:
            options: dict[str, Any] = dict(self._lineage(canvas))
            if rest:
                options["chain"] = rest
            self.sends.append((sig, args, options))
            return
        payload = sig.args[0] if sig.immutable or not args else args[0]
        if sig.kwargs.get("payload") is not None:
            payload = sig.kwargs["payload"]
        self.rows.append(self._row(spec, sig, payload, {"chain": rest, **self._lineage(canvas)}))

    def errback(self, sig: Signature, error: str, canvas: dict) -> None:
        spec = self._canvas.spec_of(sig)
        job_id = self._attempt.job_id
        if spec is None:
            self.sends.append((sig, (job_id,), self._lineage(canvas)))
        else:
            payload = sig.args[0] if sig.immutable and sig.args else {"job_id": job_id, "error": error}
            self.rows.append(self._row(spec, sig, payload, self._lineage(canvas)))

    def write(self, conn: Connection) -> list[Job]:
        # A transaction tried again after a dropped connection calls this again.
        if self._planned is None:
            self._planned = (list(self.rows), list(self.sends))
        self.rows, self.sends = list(self._planned[0]), list(self._planned[1])
        store = self._canvas._store()
        if self.chord_member is not None:
            row = store.count_down_chord(conn, self.chord_member)
            if row is not None and row["remaining"] == 0:
                store.delete_chord(conn, self.chord_member)
                members = [str(m) for m in row["members"]]
                results = store.job_results(conn, members)
                self._chord_body(from_json(row["body"]), [results.get(m) for m in members])
        if self.chord_failed is not None:
            body = store.delete_chord(conn, self.chord_failed)
            if body is not None:  # the first header job to fail: the body's errbacks, once
                body_sig = signature(from_json(body), app=self._canvas._app)
                for errback in _as_list(body_sig.options.get("link_error")):
                    self.errback(signature(errback, app=self._canvas._app), "a chord header job failed", {})
        if not self._eager:
            self._outbox = store.write_outbox(
                conn, KIND_CELERY, [to_json({"sig": g, "args": a, "options": o}) for g, a, o in self.sends]
            )
        if not self.rows:
            return []
        # keyed: a step whose frozen id already made a job is that job, created once.
        return store.insert_jobs(self.rows, keyed=True, connection=conn)

    def _chord_body(self, body: Signature, results: list) -> None:
        body = signature(body, app=self._canvas._app)
        spec = self._canvas.spec_of(body)
        if spec is None:
            self.sends.append((body, (results,), {}))
        else:
            payload = body.args[0] if body.immutable and body.args else results
            self.rows.append(self._row(spec, body, payload, {}))

    def send(self, *, delete: bool = True) -> list[str]:
        """Apply the plain signatures and delete the outbox rows (one each, in order) of
        those sent (``delete=False``: return them); the sweeper applies the rest (logged)."""
        applied = [_apply(s, a, o, eager=self._eager) for s, a, o in self.sends]
        sent = [row for row, ok in zip(self._outbox, applied) if ok]
        self._outbox = []
        if delete:
            _delete_sent(self._canvas._store(), sent)
        return sent


def _delete_sent(store: Store, ids: list[str]) -> None:
    try:
        store.delete_outbox(ids)
    except Exception:
        log.warning("celery-lease: %d follow-up(s) were sent; the sweeper may send them again", len(ids))


def _apply(sig: Signature, args: tuple, options: dict[str, Any], *, eager: bool = False) -> bool:
    """Apply one plain signature; False (logged) when it could not be sent."""
    try:
        if eager:
            sig.apply(args, **options)
        else:
            sig.apply_async(args, **options)
        return True
    except Exception:
        log.exception("celery-lease: cannot apply %s after an outcome", sig.get("task"))
        return False


class Endings:
    """What jobs ended otherwise than by success set off: an attempt failed, a job
    cancelled (``leases.cancel``, the API, revoke, a cancelled run) or ended by the
    reaper (lease expired, attempts spent) or by restart recovery. Its errbacks fire
    (the error is ours: "cancelled", "lease expired"...), and a chord it was a header
    job of is removed with its body's errbacks fired once.

    The store calls :meth:`write` inside the transaction of the transition, with the
    rows that ended (leased errbacks are created there, durably, once); the caller
    calls :meth:`send` after that commit (their wakeups, the plain errbacks).

    A leased errback is created in its job's run, except when that run is cancelled
    with the job (``leases.cancel_run``): a cancelled run takes no new job, so the
    errback is created outside any run, keeping the job as its parent.
    """

    def __init__(self, canvas: Canvas, error: str, *, run_cancelled: bool = False, eager: bool = False) -> None:
        self._canvas = canvas
        self._error = error
        self._run_cancelled = run_cancelled
        self._eager = eager
        self._follow_ups: list[FollowUp] = []
        self._created: list[Job] = []

    def write(self, conn: Connection, rows: Sequence[Any]) -> None:
        # A transaction retried after a dropped connection calls this again: start over.
        self._follow_ups, self._created = [], []
        for row in rows:
            if row["canvas"]:
                origin = Origin.of(row)
                if self._run_cancelled:
                    origin = dataclasses.replace(origin, run_id=None)
                # An ending's own error (END returns it), else the transition's.
                follow = self._canvas.after_failure(origin, row.get("error") or self._error, eager=self._eager)
                if follow is not None:
                    created = follow.write(conn)
                    self._follow_ups.append(follow)
                    self._created += created
                    detail = f"errback of {origin.job_id}"
                    self._canvas._store().log_events(conn, [(c, Event.DISPATCHED, detail) for c in created])

    def send(self) -> None:
        if self._created:
            self._canvas._producer().publish_wakeups(self._created)
        # One delete for all their outbox rows (a reap or a cancelled run ends many jobs).
        _delete_sent(self._canvas._store(), [i for follow in self._follow_ups for i in follow.send(delete=False)])
        self._follow_ups, self._created = [], []
