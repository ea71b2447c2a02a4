"""The producer side: store new jobs and wake workers for them.

``submit``/``submit_many`` write the rows (with their run and its ``dispatched`` events),
then publish one wakeup per due job, after the caller's transaction commits when inside
one (a rollback leaves neither). A broker that cannot take a wakeup never fails the
caller: the row is committed, and the sweeper delivers it later.
"""

from __future__ import annotations

import logging
import math
import uuid
import weakref
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from datetime import datetime, timedelta, timezone
from typing import Any

import sqlalchemy as sa
from celery import Celery

from celery_lease import tracing
from celery_lease.broker import wakeups
from celery_lease.broker.resends import ResendGate
from celery_lease.broker.routing import QueueRouter
from celery_lease.broker.waking import Waking
from celery_lease.db import migrate
from celery_lease.db.refused import refused_value
from celery_lease.db.schema import jobs as jobs_table
from celery_lease.db.store import Store
from celery_lease.errors import ConfigurationError, InvalidPayload, LeaseError
from celery_lease.flow.limits import parse_priority
from celery_lease.job import Job, parse_job_id
from celery_lease.kinds import JobKind
from celery_lease.payload import storable_text
from celery_lease.settings import Settings
from celery_lease.status import Event, Status

log = logging.getLogger("celery_lease")

#: Where a caller's connection keeps the wakeups to publish after its COMMIT.
_COMMIT_WAKEUPS = "celery_lease.wakeups"
#: In a connection's ``info``: a function that runs a callback after the connection's
#: transaction commits (and drops it on rollback), for transactions SQLAlchemy does not
#: commit itself (Django's: celery_lease.django.transaction).
AFTER_COMMIT = "celery_lease.after_commit"

#: Transactions a submit made without ``connection=`` joins: each takes the store and
#: returns a context manager yielding a connection in such a transaction, or None.
#: celery_lease.django adds Django's atomic blocks.
AMBIENT_TRANSACTIONS: list[Callable[[Store], AbstractContextManager[sa.Connection | None]]] = []


def run_after_time(value: datetime | timedelta | float | None) -> tuple[datetime | None, float | None]:
    """A delayed job's due time as (absolute UTC instant, delay in seconds), one of
    them set: a datetime is the caller's instant; a timedelta or seconds is a delay
    that the database counts from its own clock (see statements.submit.insert_jobs)."""
    if value is None:
        return None, None
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise InvalidPayload("run_after must be timezone-aware (e.g. datetime.now(timezone.utc))")
        return value.astimezone(timezone.utc), None
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
        if not math.isfinite(seconds) or abs(seconds) > 100 * 365 * 86400:
            raise InvalidPayload("run_after is out of range")
        return None, seconds
    raise InvalidPayload(f"run_after must be a datetime, timedelta or seconds, not {type(value).__name__}")


def _width(column: sa.Column) -> int:
    """The declared width of a VARCHAR column (PostgreSQL counts characters)."""
    kind: Any = column.type
    return int(kind.length)


def _key(value: Any) -> str:
    """One idempotency key: a string (an int or UUID is spelt as one), as wide as its column."""
    if isinstance(value, (int, uuid.UUID)) and not isinstance(value, bool):
        value = str(value)
    return storable_text(value, "idempotency_key", _width(jobs_table.c.idempotency_key))


def check_options(options: dict[str, Any]) -> dict[str, Any]:
    """Submit options checked at the boundary (types, column widths, storable text);
    raises InvalidPayload without quoting the value, so nothing reaches the database
    that it would refuse with a driver error (whose text holds the whole INSERT)."""
    out = dict(options)
    for name, column in (("tenant", jobs_table.c.tenant), ("queue", jobs_table.c.queue)):
        if out.get(name) is not None:
            storable_text(out[name], name, _width(column))
    for name in ("run_id", "parent_id", "job_id"):
        if out.get(name) is not None:
            try:
                out[name] = parse_job_id(out[name])
            except ValueError:
                raise InvalidPayload(f"{name} must be a UUID") from None
    if out.get("idempotency_key") is not None:
        out["idempotency_key"] = _key(out["idempotency_key"])
    return out


class Producer:
    def __init__(self, app: Celery, store: Store, settings: Settings, coalesces: Callable[[str], bool] | None = None) -> None:
        self._app = app
        self._store = store
        self._settings = settings
        self._hooked_engines: weakref.WeakSet[sa.Engine] = weakref.WeakSet()
        self._wakeups = wakeups.Publisher(app)
        self._resends = ResendGate(self._wakeups.queue_of, self._wakeups.waiting)
        self._router = QueueRouter(app)
        #: ``coalesces(task)``: its submits' wakeups are coalesced (broker/waking.py).
        self.waking = Waking(app, self._wakeups.routing_key, coalesces or (lambda _task: False))

    def serialize(self, spec: JobKind, payload: Any) -> Any:
        """Validate and serialize one payload; raises InvalidPayload, storing nothing."""
        return spec.codec.dump_payload(payload, self._settings.max_payload_bytes)

    def job_row(self, spec: JobKind, payload: Any, options: dict[str, Any]) -> dict[str, Any]:
        """The column values of a new pending job (payload already serialized)."""
        options = check_options(options)
        job_id = options.get("job_id")
        return {
            **self._shared_columns(spec, options, self._router.queue(spec.task, options.get("queue") or spec.queue, payload)),
            # A Celery task id chosen in advance (task_id=, a frozen canvas) is the job id.
            "id": str(uuid.uuid4()) if job_id is None else job_id,
            "payload": payload,
            "idempotency_key": options.get("idempotency_key"),
            "concurrency_key": None if spec.limits is None else spec.limits.key_for(spec.kind, payload),
        }

    def _shared_columns(self, spec: JobKind, options: dict[str, Any], queue: str | None) -> dict[str, Any]:
        """What every job of one submit shares (checked options): q.SHARED_COLUMNS
        (``queue``: routed), due_at / due_in (run_after, woken_at) and ``fair`` (its key)."""
        due_at, due_in = run_after_time(options.get("run_after"))
        return {
            "kind": spec.kind,
            "task": spec.task,
            "queue": queue,
            "status": Status.PENDING.value,
            "attempt": 0,
            "max_attempts": spec.max_attempts,
            "lease_seconds": spec.lease_seconds,
            "lease_generation": 0,
            "lease_losses": 0,
            "due_at": due_at,
            "due_in": due_in,
            "run_id": options.get("run_id"),
            "parent_id": options.get("parent_id"),
            "tenant": options.get("tenant"),
            "canvas": options.get("canvas"),
            "priority": parse_priority(options.get("priority") or 0),
            "held": None,
            "fair": spec.fair,
            # A job created by a handler carries its attempt's context (the span then
            # current); a submit's own jobs, its span's (see _write).
            "trace_context": tracing.carrier(),
        }

    def submit_many(
        self,
        spec: JobKind,
        payloads: Iterable[Any],
        *,
        idempotency_keys: Iterable[str] | None = None,
        connection: sa.Connection | None = None,
        wake: bool = True,
        **options: Any,
    ) -> list[Job]:
        options = check_options(options)  # once: every job of the call shares them
        serialized = [self.serialize(spec, p) for p in payloads]  # validate all first
        if isinstance(idempotency_keys, (str, bytes)):
            raise InvalidPayload("idempotency_keys must be a list of keys, one per payload")
        keys = None if idempotency_keys is None else [_key(k) for k in idempotency_keys]
        if keys is not None and len(keys) != len(serialized):
            raise InvalidPayload("idempotency_keys must have one key per payload")
        if keys is not None and len(set(keys)) != len(keys):
            raise InvalidPayload("idempotency_keys must be distinct within one submit_many")
        if not serialized:
            return []
        job_id = options.get("job_id")
        if job_id is not None and len(serialized) != 1:
            # A frozen Celery task id (canvas, task_id=) names exactly one job.
            raise InvalidPayload("a job id can be given for one payload only")
        # Routed per job (a router function may look at the payload; dict routes are
        # answered from the router's cache): one queue is every row's, several are per row.
        queues = self._router.queues(spec.task, options.get("queue") or spec.queue, serialized)
        shared = self._shared_columns(spec, options, queues[0])
        ids = [job_id] if job_id is not None else [str(uuid.uuid4()) for _ in serialized]
        records: list[dict[str, Any]] = [{"id": i, "payload": p} for i, p in zip(ids, serialized)]
        if len(set(queues)) > 1:
            for record, queue in zip(records, queues):
                record["queue"] = queue
        if keys is not None:
            for record, key in zip(records, keys):
                record["idempotency_key"] = key
        if spec.limits is not None:
            for record in records:
                record["concurrency_key"] = spec.limits.key_for(spec.kind, record["payload"])
        keyed = keys is not None
        if not self._store.capabilities.shared_inserts or len(set(queues)) > 1:
            rows = [{**shared, "idempotency_key": None, "concurrency_key": None, **r} for r in records]
            return self.submit_rows(rows, keyed=keyed, connection=connection, wake=wake)
        store = self._store

        def insert(conn: sa.Connection | None, landed: list[Job]) -> list[Job]:
            # The rows and their events: one statement.
            return store.insert_shared_jobs(shared, records, keyed=keyed, connection=conn, landed=landed)

        wanted = [(r["id"], spec.kind, r.get("idempotency_key")) for r in records]
        run_ids = [] if shared["run_id"] is None else [shared["run_id"]]
        return self._write(
            insert, wanted, run_ids, keyed=keyed, connection=connection, wake=wake, columns=[shared], wake_every=spec.batch
        )

    def submit_rows(
        self, rows: list[dict[str, Any]], *, keyed: bool, connection: sa.Connection | None = None, wake: bool = True
    ) -> list[Job]:
        """Store rows made by :meth:`job_row`, of one kind or several (a group's
        members), with one INSERT and their runs and ``dispatched`` events in the same
        transaction, then wake the due ones. ``keyed``: every row has an idempotency
        key, and a key already held returns the job that holds it (looked up per kind).
        Returns the jobs in the order of ``rows``."""
        if not rows:
            return []
        store = self._store

        def insert(conn: sa.Connection | None, landed: list[Job]) -> list[Job]:
            inserted = store.insert_jobs(rows, keyed=keyed, connection=conn, landed=landed)
            store.log_events(conn, [(j, Event.DISPATCHED, None) for j in inserted])
            return inserted

        wanted = [(str(r["id"]), r["kind"], r["idempotency_key"]) for r in rows]
        run_ids = list(dict.fromkeys(r["run_id"] for r in rows if r["run_id"] is not None))
        return self._write(insert, wanted, run_ids, keyed=keyed, connection=connection, wake=wake, columns=rows)

    def _write(
        self,
        insert: Callable[[sa.Connection | None, list[Job]], list[Job]],
        wanted: list[tuple[str, str, str | None]],
        run_ids: list[str],
        *,
        keyed: bool,
        connection: sa.Connection | None,
        wake: bool,
        columns: list[dict[str, Any]],
        wake_every: int | None = None,
    ) -> list[Job]:
        """One submit, inside its PRODUCER span (celery_lease.tracing) when tracing is on:
        ``columns``, the values ``insert`` binds (the rows' shared ones, or each row),
        carry that span's context into the rows."""
        with tracing.producing(wanted, columns) as context:
            if context is not None:
                for values in columns:
                    values["trace_context"] = context
            return self._store_and_wake(
                insert, wanted, run_ids, keyed=keyed, connection=connection, wake=wake, wake_every=wake_every
            )

    def _store_and_wake(
        self,
        insert: Callable[[sa.Connection | None, list[Job]], list[Job]],
        wanted: list[tuple[str, str, str | None]],
        run_ids: list[str],
        *,
        keyed: bool,
        connection: sa.Connection | None,
        wake: bool,
        wake_every: int | None = None,
    ) -> list[Job]:
        """The write of a submit: ``insert`` stores the new jobs (``wanted``: (id, kind,
        idempotency key) of each, in the caller's order) with their runs; then the due
        ones are woken. Returns the jobs of ``wanted``, in its order."""
        if connection is None:
            for ambient in AMBIENT_TRANSACTIONS:
                with ambient(self._store) as joined:
                    if joined is not None:
                        return self._store_and_wake(
                            insert, wanted, run_ids, keyed=keyed, connection=joined, wake=wake, wake_every=wake_every
                        )
        store = self._store

        def write(conn: sa.Connection | None) -> tuple[list[Job], list[Job]]:
            for run_id in run_ids:
                if not store.ensure_run(run_id, connection=conn):
                    raise LeaseError(f"run {run_id} is cancelled; it accepts no new jobs")
            # landed: rows an earlier try of this very write committed before its reply
            # was lost (with their events: a write commits whole); returned, woken,
            # not inserted or logged again.
            landed: list[Job] = []
            inserted = insert(conn, landed)
            ours = {j.id: j for j in [*inserted, *landed]}
            if not keyed:
                return list(ours.values()), [ours[job_id] for job_id, _, _ in wanted]
            # Conflicting keys inserted nothing: return the jobs that hold them.
            by_key = {(j.kind, j.idempotency_key): j for j in ours.values()}
            missing: dict[str, list[str]] = {}
            for _, kind, key in wanted:
                if (kind, key) not in by_key:
                    missing.setdefault(kind, []).append(str(key))
            for kind, kind_keys in missing.items():
                for j in store.get_jobs_by_keys(kind, kind_keys, connection=conn):
                    by_key[(kind, j.idempotency_key)] = j
            return list(ours.values()), [by_key[(kind, key)] for _, kind, key in wanted]

        try:
            if connection is not None or (not run_ids and not keyed):
                # In the caller's transaction, or a lone statement that commits by itself.
                inserted, jobs = write(connection)
            else:
                # The runs, the rows and their events (or the key lookups) commit together.
                inserted, jobs = store.transaction(store.durable, write)
        except Exception as exc:
            if migrate.schema_missing(exc):  # never migrated, or older than this version
                raise ConfigurationError(migrate.SCHEMA_MISSING) from None
            if not refused_value(exc):
                raise
            # The driver's text quotes the whole INSERT, payload included: keep it out.
            kinds = ", ".join(sorted({kind for _, kind, _ in wanted}))
            log.warning("celery-lease: the job database refused a value of a %s job (%s)", kinds, type(exc).__name__)
            name = type(exc).__name__
            raise InvalidPayload(f"the job database refused a value of this job ({name}); nothing was stored") from None
        # wake=False: eager mode runs the job in this process; nothing goes to the broker.
        due = [j for j in inserted if j.run_after is None] if wake else []
        if wake_every is not None:
            # A many-job claim's kind (one kind, one queue here): one wakeup per ``batch=`` jobs; its claim
            # takes the others (worker/many_claim.py), all marked woken by the insert.
            due = due[::wake_every]
        if connection is None:
            self.publish_wakeups(due, coalesce=True)
        else:
            self._publish_after_commit(connection, due)
        return jobs

    def _publish_after_commit(self, connection: sa.Connection, jobs: list[Job]) -> None:
        """Publish wakeups once the caller's transaction has committed.

        SQLAlchemy's Core ``commit`` event fires *before* the DBAPI commit, so the
        listener commits the DBAPI connection itself, then publishes; SQLAlchemy's own
        commit that follows finds nothing left to commit. A rollback drops the list.
        A connection whose ``info`` holds ``AFTER_COMMIT`` (Django's) says itself when.
        """
        after_commit = connection.info.get(AFTER_COMMIT)
        if after_commit is not None:
            if jobs:
                after_commit(lambda: self.publish_wakeups(jobs, coalesce=True))
            return
        pending = connection.info.setdefault(_COMMIT_WAKEUPS, [])
        pending.extend(jobs)
        engine = connection.engine
        if engine in self._hooked_engines:
            return
        self._hooked_engines.add(engine)

        def on_commit(conn):
            jobs = conn.info.pop(_COMMIT_WAKEUPS, None)
            if jobs:
                conn.connection.dbapi_connection.commit()
                self.publish_wakeups(jobs, coalesce=True)

        def on_rollback(conn):
            conn.info.pop(_COMMIT_WAKEUPS, None)

        sa.event.listen(engine, "commit", on_commit)
        sa.event.listen(engine, "rollback", on_rollback)

    def publish_sweep(self, rows: Sequence[dict]) -> int:
        """The sweeper's wakeups: its re-sends only where no earlier copy may wait (resends.py)."""
        return self.publish_wakeups(self._resends.admit(rows))

    def publish_wakeups(self, jobs: Sequence[Job | dict], *, coalesce: bool = False) -> int:
        """Publish one wakeup per job (``coalesce``, a submit's: one per kind and queue
        on its way, broker/waking.py); the Celery task id is the job id. A failure to publish
        (broker down) never fails the caller: the row is already committed, its
        woken_at is cleared, and the sweeper delivers it later."""
        if not jobs:
            return 0
        every = [(j.id, j.task, j.queue) if isinstance(j, Job) else (str(j["id"]), j["task"], j["queue"]) for j in jobs]
        items, riding, held = self.waking.split(every) if coalesce else (every, {}, [])
        try:
            self.waking.found(riding, self._wakeups.publish(items, riding, self.waking.admit))
            return len(items)
        except Exception as exc:
            log.warning(
                "celery-lease: cannot publish %d wakeup(s) (%s); the sweeper will deliver them", len(items), type(exc).__name__
            )
        self.waking.forget([*held, *(key for key, _ in riding.values())])
        try:
            self._store.mark_not_woken([job_id for job_id, _, _ in every])
        except LeaseError:
            log.warning("celery-lease: %d wakeups left to the sweeper's staleness threshold", len(every))
        return 0
