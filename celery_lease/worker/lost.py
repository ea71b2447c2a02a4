"""A pool process that died mid-job (SIGKILL: the OOM killer, ``kill -9``): Celery's
main process reports ``WorkerLostError`` for the job at once (``task_failure``). The
process that held the lease is gone, so its lease is released now, the way the reaper
would on expiry (requeued, or expired with ``"lease expired"`` on its last attempt), not
after the whole ``lease_seconds``.

Only a lease this worker's boot took (``node/pid/boot`` with this boot's id) from a
process that no longer runs is released, guarded by its fencing generation; anything
else (the job finished, was reaped or cancelled, or the pid runs again) is left alone
for the heartbeat rules and the reaper.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from billiard.exceptions import WorkerLostError
from celery import Celery, signals

from celery_lease.db.statements.lost import expire_leases_of, expire_lost_lease, running_owners
from celery_lease.errors import LeaseError
from celery_lease.job import parse_job_id
from celery_lease.status import Status
from celery_lease.worker.attempt import BOOT_ID, owner_pid
from celery_lease.worker.task import LeaseTask

if TYPE_CHECKING:
    from celery_lease.db.store import Store

log = logging.getLogger("celery_lease")


def process_gone(pid: int) -> bool:
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


def release(store: Store, reap: Callable[[], Any], job_id: str) -> bool:
    """Release the lease of ``job_id`` if a dead process of this worker boot holds it;
    returns whether it did."""
    job = store.get(parse_job_id(job_id))
    if job is None or job.status is not Status.RUNNING or not job.lease_owner:
        return False
    pid = owner_pid(job.lease_owner)
    if not job.lease_owner.endswith(f"/{BOOT_ID}") or pid is None or not process_gone(pid):
        return False
    params = {"job_id": job.id, "owner": job.lease_owner, "generation": job.lease_generation}
    if not store.guarded(expire_lost_lease(), params):
        return False
    log.warning("celery-lease: job %s: its worker process %s died; lease released", job.id, pid)
    reap()
    return True


def release_dead(store: Store) -> int:
    """Release every lease held by a pool process of this worker boot that is gone; returns
    how many. A batched kind's process (worker/batch.py) holds many leases, and the
    delivery Celery reports lost names one job at most (maybe one that had ended)."""
    owners = store.transaction(store.durable, lambda c: [r[0] for r in c.execute(running_owners(), {"pattern": f"%/{BOOT_ID}"})])
    released = 0
    for lease_owner in owners:
        pid = owner_pid(lease_owner)
        if pid is not None and process_gone(pid):
            stmt = expire_leases_of()
            released += store.transaction(store.durable, lambda c, o=lease_owner: c.execute(stmt, {"owner": o}).rowcount)
    if released:
        log.warning("celery-lease: %d lease(s) of dead worker processes released", released)
    return released


def connect(app: Celery, owner: object, *, store: Callable[[], Store], reap: Callable[[], Any]) -> None:
    """On ``WorkerLostError`` for one of ``owner``'s leased tasks, release its lease."""

    @signals.task_failure.connect(weak=False)
    def worker_lost(sender=None, task_id=None, exception=None, **_):
        if not (isinstance(sender, LeaseTask) and sender.owner is owner and isinstance(exception, WorkerLostError)):
            return
        try:
            release(store(), reap, str(task_id))
            if release_dead(store()):
                reap()
        except (LeaseError, ValueError):
            log.warning("celery-lease: job %s: its worker process died; the reaper will release it", task_id, exc_info=True)

    app._celery_lease_lost_handlers = (worker_lost,)
