"""CeleryLease: the one object a Celery app adds to get durable, leased jobs.

This module only wires the parts together and offers the public methods; each part takes
the narrow collaborators it needs (store, producer, registry, settings), never this object:

    settings.Settings      typed lease_* settings, read when first needed
    db.store.Store         engines, transactions, one method per named statement
    producer.Producer      submit / submit_many, wakeups after commit
    kinds.Registry         the job kinds @leases.job declared
    worker.*               claim, heartbeat, body, completion (Celery signals)
    flow.FlowControl       concurrency / rate limits, priority, pause (claim-time)
    beat.*                 reap / sweep / prune / recover and their beat entries
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from celery import Celery

from celery_lease import grouping, results, shared
from celery_lease.beat import entries
from celery_lease.beat.maintenance import Maintenance
from celery_lease.beat.periodic import BeatJobs, Periodic
from celery_lease.broker import cancel_notice
from celery_lease.canvas import Canvas
from celery_lease.db import migrate
from celery_lease.db.engine import Database, Timeouts
from celery_lease.db.store import Store
from celery_lease.db.urls import resolve_database_url
from celery_lease.errors import UnknownKind
from celery_lease.flow.control import FlowControl
from celery_lease.flow.limits import Limits
from celery_lease.job import Job, parse_job_id
from celery_lease.kinds import JobKind, Registry, check_batch, refuse_celery_options
from celery_lease.lifecycle import transition as tr
from celery_lease.lifecycle.pipeline import Pipeline
from celery_lease.payload import Codec
from celery_lease.producer import Producer
from celery_lease.settings import Settings, warn_unknown_keys
from celery_lease.worker import dead_processes, events, signals
from celery_lease.worker.eager import EagerRunner
from celery_lease.worker.executor import WorkerState
from celery_lease.worker.task import LeaseTask, run_leased

log = logging.getLogger("celery_lease")


class CeleryLease:
    """Durable leased jobs for one Celery app.

    ``database_url`` may also come from ``app.conf.lease_database_url`` or the
    environment variable ``CELERY_LEASE_DATABASE_URL``; with none set, a SQLite file
    ``celery-lease.sqlite3`` in the working directory is used. Settings (see
    :class:`~celery_lease.settings.Settings`) are keyword arguments here or
    ``lease_<name>`` in ``app.conf``; both are read when first needed, so configuring
    the app after constructing this object works as in any Celery project.
    """

    def __init__(self, app: Celery, database_url: str | None = None, *, install_beat: bool = True, **settings: Any) -> None:
        Settings.check_overrides(settings)
        if database_url is not None:
            Database.parse_url(database_url)  # an explicit URL is refused here, at construction
        self.app = app
        self._database_url = database_url
        self._overrides = settings
        self._settings: Settings | None = None
        self._keys_checked = False
        self._store: Store | None = None
        self._producer: Producer | None = None
        self._maintenance: Maintenance | None = None
        self._flow: FlowControl | None = None
        self._lifecycle: Pipeline | None = None
        self.registry = Registry()
        self._tasks: dict[str, LeaseTask] = {}
        self._worker: WorkerState | None = None
        self._eager: EagerRunner | None = None
        self._worker_pid = self._eager_pid = 0
        self.canvas = Canvas(app, self.registry, lambda: self.producer, lambda: self.store)
        app.lease = self  # found by the CLI plugin (`celery -A proj lease ...`) and results.py
        signals.connect(
            app,
            self,
            ping=lambda: self.store.ping(),
            size_pools=lambda concurrency: self.store.size_for_concurrency(concurrency),
            recover=self.recover,
            worker_state=lambda: self.worker,
            cancel_ids=self._revoke,
        )
        dead_processes.connect(app, self, store=lambda: self.store, reap=self.reap)  # a pool process killed mid-job
        results.install(app)  # AsyncResult(job_id) reads the row when the app has no result backend
        grouping.install(app)  # a group's leased members are one submit
        self.beat_schedule = entries.register(app, lambda: self.maintenance, lambda: self.settings, install_beat=install_beat)
        self.beat_jobs = BeatJobs(app, self.registry, lambda: self.producer, self.beat_schedule.add, self.resolve)
        self._task_modules_imported = False
        shared.attach(self)  # jobs declared with @shared_job (reusable apps)

    # --- the parts, made when first needed ---------------------------------------------

    @property
    def settings(self) -> Settings:
        if self._settings is None:
            self._settings = Settings.resolve(self.app.conf, self._overrides)
            if not self._keys_checked:  # once: reading app.conf may configure the app, whose hook reads these
                self._keys_checked = warn_unknown_keys(self.app.conf)
        return self._settings

    @property
    def store(self) -> Store:
        if self._store is None:
            url, source = resolve_database_url(self._database_url, self.app.conf)
            s = self.settings
            self._store = Store(
                url, source=source, prepare_statements=s.prepare_statements, timeouts=Timeouts.of(s), read_url=s.read_database_url
            )
        return self._store

    @property
    def producer(self) -> Producer:
        if self._producer is None:
            many = self.store.capabilities.many_job_claims and self.settings.coalesce_wakeups  # (broker/waking.py)
            self._producer = Producer(self.app, self.store, self.settings, coalesces=self.registry.claims_many if many else None)
        return self._producer

    @property
    def maintenance(self) -> Maintenance:
        if self._maintenance is None:
            self._maintenance = Maintenance(
                self.store, self.lifecycle, self.producer.publish_sweep, self.settings, flow=self.flow
            )
        return self._maintenance

    @property
    def flow(self) -> FlowControl:
        if self._flow is None:
            self._flow = FlowControl(self.store, self.app, self.producer.publish_wakeups, self.registry, lambda: self.settings)
        return self._flow

    @property
    def lifecycle(self) -> Pipeline:
        """Executes the transitions that end jobs outside a worker's attempt (cancel,
        reap, restart recovery); see celery_lease/lifecycle."""
        if self._lifecycle is None:
            self._lifecycle = Pipeline(
                self.store, self.producer, canvas=self.canvas, flow=self.flow, notify=self._notify_cancelled
            )
        return self._lifecycle

    @property
    def worker(self) -> WorkerState:
        """This process's worker side (heartbeat thread, attempts); made after fork."""
        if self._worker is None or self._worker_pid != os.getpid():
            broker = self.app.conf.broker_url
            self._worker = WorkerState(
                self.store,
                self.producer,
                self.registry,
                self.settings,
                broker,
                cancel_notice.channel(broker, self.app.main),
                canvas=self.canvas,
                flow=self.flow,
            )
            self._worker_pid = os.getpid()
        return self._worker

    @property
    def eager(self) -> EagerRunner:
        """Runs jobs in this process (eager mode, ``task.apply()``, ``task(payload)``)."""
        if self._eager is None or self._eager_pid != os.getpid():
            self._eager = EagerRunner(self.app, self.store, self.registry, self.settings, self.canvas)
            self._eager_pid = os.getpid()
        return self._eager

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
        concurrency: int | None = None,
        concurrency_key: Callable[[Any], Any] | None = None,
        rate_limit: str | None = None,
        timeout: float | None = None,
        batch: int | None = None,
        fair: bool = False,
        **celery_options: Any,
    ) -> Callable[[Callable], LeaseTask]:
        """Register ``fn(ctx, payload)`` as the handler of jobs of ``kind``.

        Flow control, enforced in the database for every worker at once (see
        :mod:`celery_lease.flow`): at most ``concurrency`` jobs of the kind run at once
        (per key, with ``concurrency_key``: a function of the payload); at most
        ``rate_limit`` claims ("20/s", "100/m", "1000/h") per window.

        ``timeout``: seconds an attempt may run; then its lease is given up and the job
        retried (an attempt spent, as for an error), and the handler is stopped at its
        next ``raise_if_cancelled()`` with anything it writes afterwards discarded.

        ``batch``: one wakeup claims up to ``batch`` due jobs of the kind and runs them one
        after another in one worker process (docs/flow-control.md#many-jobs-per-claim). ``fair``:
        claims share the workers among tenants by weight (docs/flow-control.md#fair-share).
        """
        refuse_celery_options(celery_options)  # max_retries=, bind=True, autoretry_for=...: say what to use
        limits = Limits.declare(concurrency, concurrency_key, rate_limit)
        batch = check_batch(batch, limits)
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if lease_seconds < 1:
            raise ValueError("lease_seconds must be at least 1")
        if timeout is not None and (isinstance(timeout, bool) or not timeout > 0):
            raise ValueError("timeout must be a positive number of seconds")

        def decorate(fn: Callable) -> LeaseTask:
            task_name = name or self.app.gen_task_name(fn.__name__, fn.__module__)
            spec = JobKind(
                kind=kind or fn.__name__,
                task=task_name,
                fn=fn,
                codec=Codec(fn),
                max_attempts=max_attempts,
                lease_seconds=int(lease_seconds),
                retry_backoff=retry_backoff,
                retry_backoff_max=retry_backoff_max,
                queue=queue,
                limits=limits,
                timeout=None if timeout is None else float(timeout),
                batch=batch,
                fair=bool(fair),
            )
            self.registry.add(spec)
            task = self.app.task(
                name=task_name,
                base=LeaseTask,
                bind=True,
                shared=False,
                _force_evaluate=True,
                spec=spec,
                owner=self,
                producer=staticmethod(lambda: self.producer),
                worker_state=staticmethod(lambda: self.worker),
                eager_runner=staticmethod(lambda: self.eager),
                canvas=self.canvas,
                __doc__=fn.__doc__,
            )(run_leased)
            self._tasks[spec.kind] = task
            return task

        return decorate

    def task_for(self, kind_or_task: Any) -> LeaseTask:
        """The task of a kind name (raises UnknownKind), or the task itself."""
        return self._tasks[self.resolve(kind_or_task).kind]

    def resolve(self, kind: Any) -> JobKind:
        """The kind of a name or task, importing the app's task modules first if it is not
        registered yet (raises UnknownKind when it is not registered there either)."""
        try:
            return self.registry.resolve(kind)
        except UnknownKind:
            if not self.import_task_modules():
                raise
            return self.registry.resolve(kind)

    def import_task_modules(self) -> bool:
        """Import the modules a worker imports before taking work (``include``, ``imports``,
        ``autodiscover_tasks()`` packages, with Django's setup first), so the kinds they
        declare are registered here too (the CLI, a web process). Once per process;
        returns False when already done."""
        if self._task_modules_imported:
            return False
        self._task_modules_imported = True
        self.app.loader.import_default_modules()
        return True

    @property
    def kinds(self) -> list[str]:
        return self.registry.names()

    # --- schema ----------------------------------------------------------------------

    def create_schema(self) -> str:
        """Apply the shipped migrations up to the latest; returns the revision."""
        return migrate.upgrade(self.store)

    # --- producer --------------------------------------------------------------------

    def submit(self, kind: Any, payload: Any, **options: Any) -> Job:
        """Submit a job by kind name; raises UnknownKind for a kind never registered."""
        return self.task_for(kind).submit(payload, **options)

    def publish_wakeups(self, jobs) -> int:
        return self.producer.publish_wakeups(jobs)

    # --- reads and control -----------------------------------------------------------

    def get(self, job_id: str) -> Job | None:
        job = self.store.get(parse_job_id(job_id))
        return None if job is None else job.bind(self)

    def AsyncResult(self, job_id: str) -> results.LeaseResult:
        """Celery's AsyncResult for a job, reading its row (whatever the app's backend)."""
        backend = self.app.backend
        if not isinstance(backend, results.LeaseBackend):
            backend = results.LeaseBackend(app=self.app)
        return results.LeaseResult(parse_job_id(job_id), backend=backend, app=self.app)

    def wait(self, job_id: str, timeout: float = 30.0, poll: float = 0.1) -> Job:
        """Block until the job is terminal, or raise TimeoutError. A job not created yet is
        waited for too: a chain's later step is created when the step before it succeeds."""
        job_id = parse_job_id(job_id)
        deadline = time.monotonic() + timeout
        while True:
            job = self.store.get(job_id)
            if job is not None and job.terminal:
                return job.bind(self)
            if time.monotonic() >= deadline:
                state = "does not exist" if job is None else f"is still {job.status.value}"
                raise TimeoutError(f"job {job_id} {state} after {timeout}s")
            time.sleep(poll)

    def cancel(self, job_id: str) -> bool:
        """Cancel a pending or running job at once; False when it is already terminal
        or unknown. A running handler learns at its next heartbeat (sooner when the
        broker can carry the notice) and its later writes are discarded. Its errbacks
        fire and a running job's slot is freed (the ``cancel`` transition)."""
        return bool(self.lifecycle.execute(tr.CANCEL, build={"job_id": parse_job_id(job_id)}))

    def cancel_run(self, run_id: str) -> int:
        """Cancel every non-terminal job of a run; the run accepts no new jobs."""
        run_id = parse_job_id(run_id)
        mark_run = functools.partial(self.store.mark_run_cancelled, run_id=run_id)  # in the cancel's transaction
        return len(self.lifecycle.execute(tr.CANCEL, build={"run_id": run_id}, before=mark_run, run_cancelled=True))

    def _revoke(self, job_ids: list[str]) -> list[str]:
        """A revoke broadcast's job ids (valid UUIDs): those of this app's leased tasks
        are cancelled, in one statement. Returns the ids cancelled."""
        tasks = [spec.task for spec in self.registry]
        if not tasks:
            return []
        rows = self.lifecycle.execute(tr.REVOKE, build={"ids": job_ids, "tasks": tasks})
        return [str(r["id"]) for r in rows]

    def _notify_cancelled(self, job_ids: list[str]) -> None:
        # Best-effort: the table already says cancelled; heartbeats enforce it.
        if job_ids:
            log.info("celery-lease: cancelled %d job(s)", len(job_ids))
            broker = self.app.conf.broker_url
            cancel_notice.publish(broker, job_ids, cancel_notice.channel(broker, self.app.main))
            events.announce_revoked(self.app, job_ids)  # Flower: REVOKED, also for a job no worker holds

    # --- flow control ----------------------------------------------------------------

    def pause(self, kind: Any) -> bool:
        """Claim no job of ``kind`` until resume (stored in the database: survives
        restarts); running jobs finish. False when it was already paused."""
        return self.flow.pause(self.resolve(kind).kind)

    def resume(self, kind: Any) -> int:
        """Claim ``kind`` again and wake the jobs its pause held; returns how many."""
        return self.flow.resume(self.resolve(kind).kind)

    def limits(self, tenant: str | None = None) -> list[dict]:
        """Per kind and key: limits, pause, and jobs running or waiting on each."""
        self.import_task_modules()  # every kind the workers run, not only those imported here
        return self.flow.overview(tenant)

    def run_events(self, run_id: str, **kw) -> list[dict]:
        return self.store.run_events(parse_job_id(run_id), **kw)

    def periodic(self, name: str, task: Any, every: Any, payload: Any = None) -> Periodic | None:
        """Put a leased job in the beat schedule: each slot of ``every`` (seconds, a
        timedelta, or a Celery schedule or crontab) submits ``payload`` once, keyed by
        the slot, however many beat processes fire it. See :mod:`celery_lease.beat.periodic`."""
        return self.beat_jobs.add(name, task, every, payload)

    # --- maintenance (beat runs these) -----------------------------------------------

    def reap(self) -> dict[str, int]:
        return self.maintenance.reap()

    def sweep(self) -> int:
        return self.maintenance.sweep()

    def prune(self, older_than: float | None = None) -> int:
        return self.maintenance.prune(older_than)

    def recover(self, node: str) -> dict[str, int]:
        return self.maintenance.recover(node)
