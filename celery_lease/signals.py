"""Celery's moments mapped onto lease transitions. Handlers stay thin.

- ``worker_init``: check the database is reachable; exit with one clear line if not.
- ``worker_ready``: restart recovery, before the worker takes new work.
- ``task_prerun``: claim the job (one atomic statement) and start its heartbeats.
- (the task body): run the handler; record success / failure / retry.
- ``task_postrun``: stop the attempt's heartbeats.
- ``worker_shutting_down``: warm shutdown; handlers stop at their next
  ``raise_if_cancelled()`` and hand their job off.
- ``worker_process_shutdown`` / ``worker_shutdown``: write batched successes before exit.

Celery signals are process-global, so every handler first checks that the sender
belongs to this CeleryLease's app.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING

from celery import signals

from . import notify
from .context import SHUTDOWN
from .errors import LeaseError
from .task import LeaseTask

if TYPE_CHECKING:
    from .extension import CeleryLease

log = logging.getLogger("celery_lease")


def connect(leases: "CeleryLease") -> None:
    app = leases.app

    def ours(task) -> bool:
        return isinstance(task, LeaseTask) and task.lease is leases

    @signals.worker_init.connect(weak=False)
    def check_database(sender=None, **_):
        if getattr(sender, "app", None) is not app:
            return
        try:
            leases.store.ping()
        except LeaseError as exc:
            # Signal.send swallows exceptions; a worker that cannot reach its job
            # table must not start, so exit with one readable line.
            print(f"celery-lease: {exc}", file=sys.stderr)
            raise SystemExit(1)

    @signals.worker_ready.connect(weak=False)
    def recover(sender=None, **_):
        if getattr(sender, "app", None) is not app:
            return
        counts = leases.recover(sender.hostname)
        if any(counts.values()):
            log.warning("celery-lease: restart recovery on %s: %s", sender.hostname, counts)

    @signals.task_prerun.connect(weak=False)
    def claim(sender=None, task=None, **_):
        if ours(task):
            task.request.lease_attempt = None  # stays None if the claim raises
            task.request.lease_attempt = leases.worker.begin(task)

    @signals.task_postrun.connect(weak=False)
    def release(sender=None, task=None, **_):
        if ours(task):
            leases.worker.end(getattr(task.request, "lease_attempt", None))

    @signals.worker_shutting_down.connect(weak=False)
    def suspend(sender=None, how=None, **_):
        # Only a warm shutdown lets handlers run to their next stop point.
        if how == "Warm":
            SHUTDOWN.value = 1

    @signals.worker_process_shutdown.connect(weak=False)  # a prefork child exits
    @signals.worker_shutdown.connect(weak=False)  # the main process (solo, threads pools)
    def flush(sender=None, **_):
        # Batched successes land before the process exits.
        leases.worker.flush()

    app._celery_lease_signal_handlers = (check_database, recover, claim, release, suspend, flush)


def notify_cancelled(leases: "CeleryLease", job_ids: list[str]) -> None:
    """Best-effort: the table already says cancelled; heartbeats enforce it."""
    if job_ids:
        log.info("celery-lease: cancelled %d job(s)", len(job_ids))
        notify.publish(leases, job_ids)
