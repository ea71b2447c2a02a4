"""What a handler sees of its job: JobContext, built around one leased Attempt."""

from __future__ import annotations

import multiprocessing
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from sqlalchemy.engine import Connection

from . import queries as q
from .errors import JobCancelled, JobSuspended
from .payload import check_loaded_checkpoint, dump_checkpoint

if TYPE_CHECKING:
    from .extension import CeleryLease
    from .task import LeaseTask

#: Set by the worker's main process on warm shutdown; lives in shared memory created
#: before the pool forks, so every prefork child sees it at once without a signal.
SHUTDOWN = multiprocessing.RawValue("b", 0)

#: ctx.publish() writes at most this often; the latest value always lands at the end.
PROGRESS_MIN_INTERVAL = 0.25


@dataclass
class Attempt:
    """One claimed attempt of a job: the fencing token and the lease's local state."""

    job_id: str
    generation: int
    attempt: int
    max_attempts: int
    lease_seconds: int
    run_id: str | None
    parent_id: str | None
    tenant: str | None
    payload: Any
    checkpoint: Any
    #: Set once the lease is known lost (cancelled, reaped, heartbeat gave up).
    lost: threading.Event = field(default_factory=threading.Event)
    #: monotonic time of the last claim or renewal that the database confirmed.
    renewed_at: float = field(default_factory=time.monotonic)

    @property
    def fence(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "generation": self.generation}


@dataclass
class Staged:
    """Writes that commit in the transaction recording the job's success."""

    effects: list[Callable[[Connection], Any]] = field(default_factory=list)
    children: list[tuple["LeaseTask", Any, dict]] = field(default_factory=list)


class JobContext:
    """The handler's view of its job.

    Every write it makes is fenced by the attempt's lease generation: once the lease
    is lost (cancel, reaper, another attempt), writes are discarded and ``cancelled``
    is True.
    """

    def __init__(self, leases: "CeleryLease", task: "LeaseTask", attempt: Attempt) -> None:
        self._leases = leases
        self._task = task
        self._attempt = attempt
        self._checkpoint = check_loaded_checkpoint(attempt.checkpoint, leases.max_checkpoint_bytes)
        self._progress: Any = None
        self._progress_dirty = False
        self._progress_written_at = 0.0
        self.staged = Staged()

    # --- identity ------------------------------------------------------------------

    @property
    def job_id(self) -> str:
        return self._attempt.job_id

    @property
    def attempt(self) -> int:
        return self._attempt.attempt

    @property
    def max_attempts(self) -> int:
        return self._attempt.max_attempts

    @property
    def run_id(self) -> str | None:
        return self._attempt.run_id

    @property
    def parent_id(self) -> str | None:
        return self._attempt.parent_id

    @property
    def checkpoint(self) -> Any:
        """The last checkpoint saved by this or an earlier attempt, or None."""
        return self._checkpoint

    # --- cancellation --------------------------------------------------------------

    @property
    def suspended(self) -> bool:
        """The worker is shutting down: stop and let another worker resume."""
        return bool(SHUTDOWN.value)

    @property
    def cancelled(self) -> bool:
        return self._attempt.lost.is_set() or self.suspended

    def raise_if_cancelled(self) -> None:
        """Cooperative stop point: raises JobCancelled when the job was cancelled or
        its lease lost, JobSuspended on warm shutdown."""
        if self._attempt.lost.is_set():
            raise JobCancelled(self.job_id)
        if self.suspended:
            raise JobSuspended(self.job_id)

    def heartbeat(self) -> bool:
        """Renew the lease now (the background heartbeat does this on its own).
        Returns False when the lease is lost."""
        return self._leases.worker.heartbeat.renew_now(self._attempt)

    # --- fenced writes -------------------------------------------------------------

    def _write(self, stmt, **params) -> bool:
        if self._attempt.lost.is_set():
            return False
        if self._leases.store.write_fenced(stmt, **self._attempt.fence, **params):
            return True
        self._attempt.lost.set()
        return False

    def save_checkpoint(self, data: Any) -> bool:
        """Store ``data`` (JSON, capped) as the checkpoint; the next attempt starts from
        it. Returns False, writing nothing, when the lease is lost."""
        data = dump_checkpoint(data, self._leases.max_checkpoint_bytes)
        if not self._write(q.save_checkpoint(), new_checkpoint=data):
            return False
        self._checkpoint = data
        return True

    def publish(self, partial: Any) -> None:
        """Make ``partial`` visible as the job's progress while it runs.

        Coalesced: a tight loop may call this thousands of times a second; at most one
        write per PROGRESS_MIN_INTERVAL reaches the database, and the last value is
        written with the job's completion.
        """
        dump_checkpoint(partial, self._leases.max_checkpoint_bytes)  # JSON and size check
        self._progress = partial
        self._progress_dirty = True
        if time.monotonic() - self._progress_written_at >= PROGRESS_MIN_INTERVAL:
            self.flush_progress()

    def flush_progress(self) -> None:
        if not self._progress_dirty:
            return
        self._progress_dirty = False
        self._progress_written_at = time.monotonic()
        if self._write(q.publish_progress(), new_progress=self._progress):
            self._task.emit_progress(self._progress)

    @property
    def pending_progress(self) -> Any:
        return self._progress if self._progress_dirty else None

    # --- work that commits with success --------------------------------------------

    def effect(self, fn: Callable[[Connection], Any]) -> None:
        """Run ``fn(connection)`` inside the transaction that records this job's
        success, after its fenced status update matched. If the lease was lost, that
        transaction rolls back and none of ``fn``'s writes commit: the handler's own
        rows are written exactly once, by the attempt that succeeds."""
        self.staged.effects.append(fn)

    def submit(self, task: "LeaseTask | str", payload: Any, **options) -> None:
        """Submit a child job, created in the same transaction as this job's success
        (no child without the parent's success). It inherits this job's run and
        tenant, and has this job as its parent."""
        task = self._leases.task_for(task)
        options.setdefault("run_id", self.run_id)
        options.setdefault("tenant", self._attempt.tenant)
        options["parent_id"] = self.job_id
        self.staged.children.append((task, task.codec.dump_payload(payload), options))
