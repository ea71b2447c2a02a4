"""What a handler sees of its job: JobContext, built around one leased Attempt."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import Connection

from celery_lease.db.statements import attempt as attempt_sql
from celery_lease.errors import JobCancelled, JobSnoozed, JobSuspended
from celery_lease.kinds import JobKind
from celery_lease.payload import DEFAULT_MAX_PROGRESS_BYTES, check_loaded_checkpoint, dump_checkpoint, dump_progress
from celery_lease.producer import check_options
from celery_lease.worker import shutdown

if TYPE_CHECKING:
    from celery_lease.db.store import Store
    from celery_lease.kinds import Registry
    from celery_lease.producer import Producer
    from celery_lease.worker.attempt import Attempt
    from celery_lease.worker.heartbeat import Heartbeat

#: ctx.publish() writes at most this often; the latest value always lands at the end.
PROGRESS_MIN_INTERVAL = 0.25
#: The longest ctx.snooze(): a year.
MAX_SNOOZE_SECONDS = 365 * 86400.0


@dataclass
class Staged:
    """Writes that commit in the transaction recording the job's success."""

    effects: list[Callable[[Connection], Any]] = field(default_factory=list)
    #: (kind, serialized payload, submit options) of each child job.
    children: list[tuple[JobKind, Any, dict]] = field(default_factory=list)


class JobContext:
    """The handler's view of its job (its first argument; docs/guide.md has the table).

    Identity: ``job_id``, ``attempt``, ``max_attempts``, ``run_id``, ``parent_id``,
    ``fencing_token``, ``checkpoint``. Stopping: ``cancelled``, ``suspended``,
    ``raise_if_cancelled()``, ``snooze(seconds)``, ``heartbeat()``. Fenced writes:
    ``publish(partial)``, ``flush_progress()``, ``save_checkpoint(data)``. Committed with
    the success: ``effect(fn)``, ``submit(task, payload, **options)``.

    Every write it makes is fenced by the attempt's lease generation: once the lease
    is lost (cancel, reaper, another attempt), writes are discarded and ``cancelled``
    is True.
    """

    def __init__(
        self,
        attempt: Attempt,
        *,
        store: Store,
        producer: Producer,
        registry: Registry,
        heartbeat: Heartbeat,
        max_checkpoint_bytes: int,
        on_progress: Callable[[Any], None] | None = None,
        max_progress_bytes: int = DEFAULT_MAX_PROGRESS_BYTES,
    ) -> None:
        self._attempt = attempt
        self._store = store
        self._producer = producer
        self._registry = registry
        self._heartbeat = heartbeat
        self._max_checkpoint_bytes = max_checkpoint_bytes
        self._max_progress_bytes = max_progress_bytes
        self._on_progress = on_progress
        self._checkpoint = check_loaded_checkpoint(attempt.checkpoint, max_checkpoint_bytes)
        self._progress: Any = None
        self._progress_dirty = False
        self._progress_written_at = 0.0
        #: What effect() and submit() staged; the worker writes it with the success (not for handlers).
        self.staged = Staged()

    # --- identity ------------------------------------------------------------------

    @property
    def job_id(self) -> str:
        """The job's id (a UUID string), which is also its Celery task id."""
        return self._attempt.job_id

    @property
    def attempt(self) -> int:
        """This attempt's number, 1 for the first; a snooze or a warm-shutdown hand-off
        gives its attempt back, so the next run has the same number."""
        return self._attempt.attempt

    @property
    def max_attempts(self) -> int:
        """The kind's max_attempts: on the last attempt an exception fails the job
        (error "internal error") instead of retrying it."""
        return self._attempt.max_attempts

    @property
    def run_id(self) -> str | None:
        """The run the job belongs to (children submitted here join it), or None."""
        return self._attempt.run_id

    @property
    def parent_id(self) -> str | None:
        """The job whose success created this one (ctx.submit, a chain's previous step), or None."""
        return self._attempt.parent_id

    @property
    def fencing_token(self) -> int:
        """An int greater than that of every earlier attempt of this job: the lease
        generation it claimed (every claim commits a greater one, durably, so a crash of
        the database cannot hand it out twice). Give it to a system that accepts
        conditional writes, so it refuses an older holder's (docs/fencing.md)."""
        return self._attempt.generation

    @property
    def checkpoint(self) -> Any:
        """The last checkpoint saved by this or an earlier attempt, or None."""
        return self._checkpoint

    # --- cancellation --------------------------------------------------------------

    @property
    def suspended(self) -> bool:
        """The worker is shutting down: stop and let another worker resume."""
        return shutdown.requested()

    @property
    def cancelled(self) -> bool:
        """True once the job was cancelled or its lease lost (reaped, timed out), or while
        the worker shuts down warm: stop at the next raise_if_cancelled()."""
        return self._attempt.is_lost or self.suspended

    def raise_if_cancelled(self) -> None:
        """Cooperative stop point: raises JobCancelled when the job was cancelled or
        its lease lost, JobSuspended on warm shutdown."""
        if self._attempt.is_lost:
            raise JobCancelled(self.job_id)
        if self.suspended:
            raise JobSuspended(self.job_id)

    def snooze(self, seconds: float) -> None:
        """End this attempt without spending it: the job goes back to pending, due in
        ``seconds`` (the sweeper wakes it then; 0 wakes it at once), keeping its
        checkpoint. Not a failure: a job may snooze any number of times, whatever its
        max_attempts. Raises JobSnoozed, so nothing after it runs; do not catch it."""
        # (NaN fails the range check too.)
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (0 <= seconds <= MAX_SNOOZE_SECONDS):
            raise ValueError(f"snooze takes seconds from 0 to {MAX_SNOOZE_SECONDS:g}, not {seconds!r}")
        self.flush_progress()
        raise JobSnoozed(float(seconds))

    def heartbeat(self) -> bool:
        """Renew the lease now (the background heartbeat does this on its own).
        Returns False when the lease is lost."""
        return self._heartbeat.renew_now(self._attempt)

    # --- fenced writes -------------------------------------------------------------

    def save_checkpoint(self, data: Any) -> bool:
        """Store ``data`` (JSON, capped) as the checkpoint; the next attempt starts from
        it. Returns False, writing nothing, when the lease is lost."""
        data = dump_checkpoint(data, self._max_checkpoint_bytes)
        if not self._attempt.write(self._store, attempt_sql.save_checkpoint(), new_checkpoint=data):
            return False
        self._checkpoint = data
        return True

    def publish(self, partial: Any) -> None:
        """Make ``partial`` visible as the job's progress while it runs.

        Coalesced: a tight loop may call this thousands of times a second; at most one
        write per PROGRESS_MIN_INTERVAL reaches the database, and the last value is
        written with the job's completion.
        """
        dump_progress(partial, self._max_progress_bytes)  # storable JSON under its cap, else UnstorableValue
        self._progress = partial
        self._progress_dirty = True
        if time.monotonic() - self._progress_written_at >= PROGRESS_MIN_INTERVAL:
            self.flush_progress()

    def flush_progress(self) -> None:
        """Write the value publish() is holding back now, rather than at the next write
        or with the outcome; nothing when there is none or the lease is lost."""
        if not self._progress_dirty:
            return
        self._progress_dirty = False
        self._progress_written_at = time.monotonic()
        if self._attempt.write(self._store, attempt_sql.publish_progress(), new_progress=self._progress):
            if self._on_progress is not None:
                self._on_progress(self._progress)

    @property
    def pending_progress(self) -> Any:
        """The published value not written yet (None when none is waiting): the worker
        writes it with the outcome."""
        return self._progress if self._progress_dirty else None

    # --- work that commits with success --------------------------------------------

    def effect(self, fn: Callable[[Connection], Any]) -> None:
        """Run ``fn(connection)`` inside the transaction that records this job's
        success, after its fenced status update matched. If the lease was lost, that
        transaction rolls back and none of ``fn``'s writes commit: the handler's own
        rows are written exactly once, by the attempt that succeeds."""
        self.staged.effects.append(fn)

    def submit(self, task: Any, payload: Any, **options) -> None:
        """Submit a child job, created in the same transaction as this job's success
        (no child without the parent's success). It inherits this job's run and
        tenant, and has this job as its parent. ``task``: a kind name or leased task;
        ``options``: submit's (queue=, priority=, run_after=, idempotency_key=, ...); its
        queue is routed as any submit's (celery_lease.broker.routing)."""
        spec = self._registry.resolve(task)
        options.setdefault("run_id", self.run_id)
        options.setdefault("tenant", self._attempt.tenant)
        options["parent_id"] = self.job_id
        options = check_options(options)  # refused here, in the handler, not at commit
        self.staged.children.append((spec, self._producer.serialize(spec, payload), options))
