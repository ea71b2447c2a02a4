"""CeleryLease: the one object a Celery app adds to get durable, leased jobs."""

from __future__ import annotations

import logging
import os
import time
import uuid
import weakref
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Iterable, Sequence

import sqlalchemy as sa
from celery import Celery

from . import maintenance, migrate, schedule, signals, wakeups
from . import queries as q
from .errors import InvalidPayload, LeaseError, UnknownKind
from .job import Job
from .payload import DEFAULT_MAX_CHECKPOINT_BYTES, DEFAULT_MAX_PAYLOAD_BYTES, Codec
from .status import Event, Status
from .store import Store, resolve_database_url
from .task import LeaseTask, run_leased
from .worker import WorkerState

log = logging.getLogger("celery_lease")

#: Settings read from ``app.conf`` (constructor arguments of the same name, without the
#: ``lease_`` prefix, take precedence). Intervals are seconds.
DEFAULTS = {
    "lease_reap_interval": 10.0,  # beat: requeue or expire jobs whose lease elapsed
    "lease_sweep_interval": 5.0,  # beat: publish due wakeups (delayed jobs, retries, lost messages)
    "lease_sweep_stale_seconds": 30.0,  # a pending job's wakeup is re-sent after this long
    "lease_prune_interval": 3600.0,  # beat: delete old terminal jobs
    "lease_retention_seconds": 7 * 86400.0,  # terminal jobs are kept this long
    "lease_batch_size": 500,  # rows per reap / sweep / prune statement
    "lease_prepare_statements": True,  # PostgreSQL: PREPARE the per-job statements (see prepared.py)
    "lease_maintenance_queue": "celery_lease",  # beat's reap/sweep/prune ticks; every worker consumes it
    "lease_max_checkpoint_bytes": DEFAULT_MAX_CHECKPOINT_BYTES,
    "lease_max_payload_bytes": DEFAULT_MAX_PAYLOAD_BYTES,
}

_COMMIT_WAKEUPS = "celery_lease.wakeups"


def parse_job_id(value: Any) -> str:
    """Validate a job (or run) id at the boundary; raises ValueError."""
    try:
        return str(uuid.UUID(str(value)))
    except ValueError:
        raise ValueError(f"not a job id (expected a UUID): {str(value)[:64]!r}") from None


def _run_after(value: datetime | timedelta | float | None) -> datetime | None:
    if value is None:
        return None
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise InvalidPayload("run_after must be timezone-aware (e.g. datetime.now(timezone.utc))")
        return value.astimezone(timezone.utc)
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return datetime.now(timezone.utc) + timedelta(seconds=float(value))
    raise InvalidPayload(f"run_after must be a datetime, timedelta or seconds, not {type(value).__name__}")


class CeleryLease:
    """Durable leased jobs for one Celery app.

    ``database_url`` may also come from ``app.conf.lease_database_url`` or the
    environment variable ``CELERY_LEASE_DATABASE_URL``; with none set, a SQLite file
    ``celery-lease.sqlite3`` in the working directory is used.
    """

    def __init__(self, app: Celery, database_url: str | None = None, *, install_beat: bool = True,
                 **settings: Any) -> None:
        url, source = resolve_database_url(database_url, app.conf)
        self.app = app
        self.settings = dict(DEFAULTS)
        for key in DEFAULTS:
            if app.conf.get(key) is not None:
                self.settings[key] = app.conf.get(key)
        for key, value in settings.items():
            if f"lease_{key}" not in DEFAULTS:
                raise TypeError(f"CeleryLease got an unknown setting {key!r}")
            self.settings[f"lease_{key}"] = value
        self.store = Store(url, source=source, prepare_statements=bool(self.settings["lease_prepare_statements"]))
        self.max_checkpoint_bytes = int(self.settings["lease_max_checkpoint_bytes"])
        self._tasks: dict[str, LeaseTask] = {}
        self._worker: WorkerState | None = None
        self._worker_pid = 0
        self._hooked_engines: "weakref.WeakSet" = weakref.WeakSet()
        app.lease = self  # found by the CLI plugin: `celery -A proj lease ...`
        signals.connect(self)
        maintenance.register(self, install_beat=install_beat)
        self.beat_jobs = schedule.BeatJobs(self)

    # --- registration ----------------------------------------------------------------

    def job(
        self,
        kind: str | None = None,
        *,
        max_attempts: int = 3,
        lease_seconds: int = 60,
        retry_backoff: float = 1.0,
        retry_backoff_max: float = 300.0,
        queue: str | None = None,
        name: str | None = None,
    ) -> Callable[[Callable], LeaseTask]:
        """Register ``fn(ctx, payload)`` as the handler of jobs of ``kind``."""
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if lease_seconds < 1:
            raise ValueError("lease_seconds must be at least 1")

        def decorate(fn: Callable) -> LeaseTask:
            job_kind = kind or fn.__name__
            if job_kind in self._tasks:
                raise ValueError(f"job kind {job_kind!r} is already registered")
            task = self.app.task(
                name=name or self.app.gen_task_name(fn.__name__, fn.__module__),
                base=LeaseTask,
                bind=True,
                shared=False,
                _force_evaluate=True,
                lease=self,
                kind=job_kind,
                fn=staticmethod(fn),
                codec=Codec(fn, max_payload_bytes=int(self.settings["lease_max_payload_bytes"])),
                max_attempts=max_attempts,
                lease_seconds=int(lease_seconds),
                retry_backoff=retry_backoff,
                retry_backoff_max=retry_backoff_max,
                lease_queue=queue,
                __doc__=fn.__doc__,
            )(run_leased)
            self._tasks[job_kind] = task
            return task

        return decorate

    def task_for(self, kind_or_task: "str | LeaseTask") -> LeaseTask:
        if isinstance(kind_or_task, LeaseTask):
            return kind_or_task
        try:
            return self._tasks[kind_or_task]
        except KeyError:
            known = ", ".join(sorted(self._tasks)) or "none"
            raise UnknownKind(f"no job handler for kind {kind_or_task!r} (registered: {known})") from None

    @property
    def kinds(self) -> list[str]:
        return sorted(self._tasks)

    @property
    def worker(self) -> WorkerState:
        """This process's worker side (heartbeat thread, attempts); made after fork."""
        if self._worker is None or self._worker_pid != os.getpid():
            self._worker = WorkerState(self)
            self._worker_pid = os.getpid()
        return self._worker

    # --- schema ----------------------------------------------------------------------

    def create_schema(self) -> str:
        """Apply the shipped migrations up to the latest; returns the revision."""
        return migrate.upgrade(self.store)

    # --- producer --------------------------------------------------------------------

    def submit(self, kind: "str | LeaseTask", payload: Any, **options: Any) -> Job:
        """Submit a job by kind name; raises UnknownKind for a kind never registered."""
        return self.task_for(kind).submit(payload, **options)

    def job_row(self, task: LeaseTask, payload: Any, options: dict) -> dict[str, Any]:
        """The column values of a new pending job (payload already serialized)."""
        run_after = _run_after(options.get("run_after"))
        run_id = options.get("run_id")
        parent_id = options.get("parent_id")
        return {
            "id": str(uuid.uuid4()),
            "kind": task.kind,
            "task": task.name,
            "queue": options.get("queue") or task.lease_queue,
            "status": Status.PENDING.value,
            "attempt": 0,
            "max_attempts": task.max_attempts,
            "lease_seconds": task.lease_seconds,
            "lease_generation": 0,
            "lease_losses": 0,
            "payload": payload,
            "run_after": run_after,
            # A job due now is woken by submit itself; a delayed one by the sweeper.
            "woken_at": None if run_after else datetime.now(timezone.utc),
            "run_id": None if run_id is None else parse_job_id(run_id),
            "parent_id": None if parent_id is None else parse_job_id(parent_id),
            "idempotency_key": options.get("idempotency_key"),
            "tenant": options.get("tenant"),
        }

    def submit_many(
        self,
        task: LeaseTask,
        payloads: Iterable[Any],
        *,
        idempotency_keys: Iterable[str] | None = None,
        connection: sa.Connection | None = None,
        **options: Any,
    ) -> list[Job]:
        serialized = [task.codec.dump_payload(p) for p in payloads]  # validate all first
        keys = None if idempotency_keys is None else [str(k) for k in idempotency_keys]
        if keys is not None and len(keys) != len(serialized):
            raise InvalidPayload("idempotency_keys must have one key per payload")
        if keys is not None and len(set(keys)) != len(keys):
            raise InvalidPayload("idempotency_keys must be distinct within one submit_many")
        rows = [
            self.job_row(task, payload, {**options, "idempotency_key": None if keys is None else keys[i]})
            for i, payload in enumerate(serialized)
        ]
        if not rows:
            return []
        run_id = rows[0]["run_id"]

        def write(conn: sa.Connection | None) -> tuple[list[Job], list[Job]]:
            if run_id is not None and not self.store.ensure_run(run_id, connection=conn):
                raise LeaseError(f"run {run_id} is cancelled; it accepts no new jobs")
            inserted = self.store.insert_jobs(rows, keyed=keys is not None, connection=conn)
            if keys is None:
                jobs = inserted
            else:
                # Conflicting keys inserted nothing: return the jobs that hold them.
                by_key = {j.idempotency_key: j for j in inserted}
                missing = [k for k in keys if k not in by_key]
                if missing:
                    for j in self.store.get_jobs_by_keys(task.kind, missing, connection=conn):
                        by_key[j.idempotency_key] = j
                jobs = [by_key[k] for k in keys]
            if run_id is not None:
                self.store.append_events(
                    [q.event_row(run_id, j.id, Event.DISPATCHED, 0) for j in inserted], connection=conn)
            return inserted, jobs

        if connection is not None or (run_id is None and keys is None):
            # In the caller's transaction, or a lone INSERT that commits by itself.
            inserted, jobs = write(connection)
        else:
            # The run, the rows and their events (or the key lookups) commit together.
            inserted, jobs = self.store.run(self.store.durable, write)
        due = [j for j in inserted if j.run_after is None]
        if connection is None:
            self.publish_wakeups(due)
        else:
            self._publish_after_commit(connection, due)
        return jobs

    def _publish_after_commit(self, connection: sa.Connection, jobs: list[Job]) -> None:
        """Publish wakeups once the caller's transaction has committed.

        SQLAlchemy's Core ``commit`` event fires *before* the DBAPI commit, so the
        listener commits the DBAPI connection itself, then publishes; SQLAlchemy's own
        commit that follows finds nothing left to commit. A rollback drops the list.
        """
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
                self.publish_wakeups(jobs)

        def on_rollback(conn):
            conn.info.pop(_COMMIT_WAKEUPS, None)

        sa.event.listen(engine, "commit", on_commit)
        sa.event.listen(engine, "rollback", on_rollback)

    def publish_wakeups(self, jobs: Sequence[Job | dict]) -> int:
        """Publish one wakeup per job; the Celery task id is the job id.

        A failure to publish (broker down) never fails the caller: the row is already
        committed, its woken_at is cleared, and the sweeper delivers it later.
        """
        if not jobs:
            return 0
        items = [(j.id, j.task, j.queue) if isinstance(j, Job) else (str(j["id"]), j["task"], j["queue"])
                 for j in jobs]
        try:
            wakeups.publish(self.app, items)
            return len(items)
        except Exception as exc:
            log.warning("celery-lease: cannot publish %d wakeup(s) (%s); the sweeper will deliver them",
                        len(items), type(exc).__name__)
        try:
            self.store.mark_not_woken([job_id for job_id, _, _ in items])
        except LeaseError:
            log.warning("celery-lease: %d wakeups left to the sweeper's staleness threshold", len(items))
        return 0

    # --- reads and control -----------------------------------------------------------

    def get(self, job_id: str) -> Job | None:
        return self.store.get(parse_job_id(job_id))

    def wait(self, job_id: str, timeout: float = 30.0, poll: float = 0.1) -> Job:
        """Block until the job is terminal; raises TimeoutError, or LookupError when
        there is no such job."""
        job_id = parse_job_id(job_id)
        deadline = time.monotonic() + timeout
        while True:
            job = self.store.get(job_id)
            if job is None:
                raise LookupError(f"no job {job_id}")
            if job.terminal:
                return job
            if time.monotonic() >= deadline:
                raise TimeoutError(f"job {job_id} is still {job.status.value} after {timeout}s")
            time.sleep(poll)

    def cancel(self, job_id: str) -> bool:
        """Cancel a pending or running job at once; False when it is already terminal
        or unknown. A running handler learns at its next heartbeat (sooner when the
        broker can carry the notice) and its later writes are discarded."""
        cancelled = self.store.cancel(job_id=parse_job_id(job_id))
        signals.notify_cancelled(self, cancelled)
        return bool(cancelled)

    def cancel_run(self, run_id: str) -> int:
        """Cancel every non-terminal job of a run; the run accepts no new jobs."""
        cancelled = self.store.cancel(run_id=parse_job_id(run_id))
        signals.notify_cancelled(self, cancelled)
        return len(cancelled)

    def run_events(self, run_id: str, **kw) -> list[dict]:
        return self.store.run_events(parse_job_id(run_id), **kw)

    def periodic(self, name: str, task: "str | LeaseTask", every: Any, payload: Any = None) -> "schedule.Periodic":
        """Put a leased job in the beat schedule: each slot of ``every`` (seconds, a
        timedelta, or a Celery schedule or crontab) submits ``payload`` once, keyed by
        the slot, however many beat processes fire it. See :mod:`celery_lease.schedule`."""
        return self.beat_jobs.add(name, task, every, payload)

    # --- maintenance (beat runs these) -----------------------------------------------

    def reap(self) -> dict[str, int]:
        return maintenance.reap(self)

    def sweep(self) -> int:
        return maintenance.sweep(self)

    def prune(self, older_than: float | None = None) -> int:
        return maintenance.prune(self, older_than)

    def recover(self, node: str) -> dict[str, int]:
        return maintenance.recover(self, node)
