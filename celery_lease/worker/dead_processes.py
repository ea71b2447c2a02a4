"""A pool process that died mid-job (SIGKILL: the OOM killer, ``kill -9``): Celery's
main process reports ``WorkerLostError`` for the job at once (``task_failure``). The
process that held the lease is dead, so its lease is released now, the way the reaper
would on expiry (requeued, or expired with ``"lease expired"`` on its last attempt), not
after the whole ``lease_seconds``.

Every lease this worker's boot took (owners ending in this boot's id) from a process
that no longer runs is released, not only the reported job's: a process that ran a
many-job claim held many. An owner names one process (lifecycle/owner.owner_of), so no live attempt's
lease is touched; anything else (the job finished, was reaped or cancelled) is left
alone for the heartbeat rules and the reaper.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from billiard.exceptions import WorkerLostError
from celery import Celery, signals

from celery_lease.db.statements.dead_processes import expire_leases_of, running_owners
from celery_lease.errors import LeaseError
from celery_lease.lifecycle.owner import BOOT_ID, owner_pid
from celery_lease.worker.task import LeaseTask

if TYPE_CHECKING:
    from celery_lease.db.store import Store

log = logging.getLogger("celery_lease")


def process_dead(pid: int) -> bool:
    """True when no process ``pid`` runs (none, or a zombie not yet reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def release_dead(store: Store) -> int:
    """Release every lease held by a pool process of this worker boot that is dead; returns
    how many. A process running a many-job claim (worker/many_claim.py) holds many leases, and the
    delivery Celery reports lost names one job at most (maybe one that had ended)."""
    owners = store.transaction(store.durable, lambda c: [r[0] for r in c.execute(running_owners(), {"pattern": f"%/{BOOT_ID}"})])
    released = 0
    for lease_owner in owners:
        pid = owner_pid(lease_owner)
        if pid is not None and process_dead(pid):
            stmt = expire_leases_of()
            n = store.transaction(store.durable, lambda c, o=lease_owner: c.execute(stmt, {"owner": o}).rowcount)
            if n:
                log.warning("celery-lease: %d job(s) of its worker process %s that died: lease released", n, lease_owner)
            released += n
    return released


def connect(app: Celery, owner: object, *, store: Callable[[], Store], reap: Callable[[], Any]) -> None:
    """On ``WorkerLostError`` for one of ``owner``'s leased tasks, release its lease."""

    @signals.task_failure.connect(weak=False)
    def worker_lost(sender=None, task_id=None, exception=None, **_):
        if not (isinstance(sender, LeaseTask) and sender.owner is owner and isinstance(exception, WorkerLostError)):
            return
        try:
            # Every lease of the dead process, not only this task's (a many-job
            # claim's process held many): one mechanism whatever the process held.
            if release_dead(store()):
                reap()
        except LeaseError:
            log.warning("celery-lease: job %s: its worker process died; the reaper will release it", task_id, exc_info=True)

    app._celery_lease_lost_handlers = (worker_lost,)
