"""Reaper, sweeper, pruner and restart recovery, and the beat entries that run them.

Each works in bounded batches (``lease_batch_size`` rows per statement, a bounded
number of statements per call) and returns counts. Beat tasks only call them; several
beats may run them at once, since every batch is selected with SKIP LOCKED on
PostgreSQL (SQLite serializes writers).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from celery.signals import celeryd_after_setup

from .status import Status

if TYPE_CHECKING:
    from .extension import CeleryLease

log = logging.getLogger("celery_lease.maintenance")

#: Upper bound on statements one call issues; what is left waits for the next tick.
MAX_BATCHES = 20

REAP_TASK = "celery_lease.reap"
SWEEP_TASK = "celery_lease.sweep"
PRUNE_TASK = "celery_lease.prune"


def _batches(step) -> list:
    out = []
    for _ in range(MAX_BATCHES):
        rows, full = step()
        out.extend(rows)
        if not full:
            break
    return out


def _requeue_counts(leases: "CeleryLease", rows: list[dict], final: Status) -> dict[str, int]:
    requeued = [r for r in rows if r["status"] == Status.PENDING.value]
    leases.publish_wakeups(requeued)
    return {"requeued": len(requeued), final.value: len(rows) - len(requeued)}


def reap(leases: "CeleryLease") -> dict[str, int]:
    """Running jobs whose lease elapsed: back to pending with a wakeup while attempts
    remain, else expired with error "lease expired"."""
    limit = int(leases.settings["lease_batch_size"])

    def step():
        rows = leases.store.reap(limit)
        return rows, len(rows) == limit

    counts = _requeue_counts(leases, _batches(step), Status.EXPIRED)
    if any(counts.values()):
        log.warning("celery-lease: reaped expired leases: %s", counts)
    return counts


def recover(leases: "CeleryLease", node: str) -> dict[str, int]:
    """Jobs left running by an earlier boot of worker ``node``: requeued, or failed with
    "interrupted by restart" when no attempts remain."""
    from .worker import BOOT_ID

    return _requeue_counts(leases, leases.store.recover(node, BOOT_ID), Status.FAILED)


def sweep(leases: "CeleryLease") -> int:
    """Publish wakeups for due pending jobs whose last wakeup is stale or missing."""
    limit = int(leases.settings["lease_batch_size"])
    stale = float(leases.settings["lease_sweep_stale_seconds"])

    def step():
        rows = leases.store.claim_due_wakeups(stale, limit)
        return rows, len(rows) == limit

    rows = _batches(step)
    sent = leases.publish_wakeups(rows)
    if rows:
        log.info("celery-lease: swept %d wakeup(s), %d published", len(rows), sent)
    return sent


def prune(leases: "CeleryLease", older_than: float | None = None) -> int:
    """Delete terminal jobs (and their events) finished more than ``older_than``
    seconds ago (default: ``lease_retention_seconds``)."""
    age = float(leases.settings["lease_retention_seconds"] if older_than is None else older_than)
    limit = int(leases.settings["lease_batch_size"])

    def step():
        n = leases.store.prune(age, limit)
        return [None] * n, n == limit

    return len(_batches(step))


def register(leases: "CeleryLease", *, install_beat: bool) -> None:
    """Register the maintenance tasks and, unless disabled, their beat entries."""
    app = leases.app
    s = leases.settings

    def reap_task():
        return leases.reap()

    def sweep_task():
        return leases.sweep()

    def prune_task():
        return leases.prune()

    tasks = {
        REAP_TASK: (reap_task, s["lease_reap_interval"]),
        SWEEP_TASK: (sweep_task, s["lease_sweep_interval"]),
        PRUNE_TASK: (prune_task, s["lease_prune_interval"]),
    }
    queue = s["lease_maintenance_queue"]
    for name, (fn, interval) in tasks.items():
        app.task(name=name, shared=False, ignore_result=True, _force_evaluate=True)(fn)
        if install_beat:
            # Own queue: behind a backlog of wakeups on the default queue, a tick would
            # wait (and expire) while reaping is most needed. expires: a tick that
            # waited longer than its interval (workers down) is dropped, not piled up.
            options = {"expires": float(interval), "queue": queue}
            app.conf.beat_schedule = {
                **(app.conf.beat_schedule or {}),
                name: {"task": name, "schedule": float(interval), "options": options},
            }

    @celeryd_after_setup.connect(weak=False)
    def consume_maintenance_queue(sender=None, instance=None, **_):
        # Every worker of this app also consumes the maintenance queue, whatever -Q says.
        if instance is not None and instance.app is app:
            instance.app.amqp.queues.select_add(queue)
