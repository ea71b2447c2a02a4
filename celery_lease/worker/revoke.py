"""Celery's revoke, on a leased job, is a durable cancel of the job.

Celery's worker keeps revoked task ids in memory only: a revoked leased job would stay
``pending`` in its row, and every later wakeup would be discarded, forever. So:

* the worker's ``revoke`` control command (``celery control revoke ID``,
  ``app.control.revoke``, ``AsyncResult.revoke``) first cancels the job in its row, then
  does what Celery does (with ``terminate=True``, kill the process running it). A pending
  job is cancelled at once; a running one's handler learns at its next heartbeat (sooner
  through the cancel notice) and its later writes are discarded;
* ``task_revoked`` (a revoked wakeup discarded, a terminated task) cancels the job too,
  which covers revokes a worker kept from before (``--statedb``).

Cancelling a job that is already terminal, or an id that is no job, changes nothing. A
revoke broadcast while no worker runs reaches nobody, as in Celery: ``leases.cancel(id)``
or ``LeaseResult.revoke()`` cancel in the database directly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from celery import Celery, signals
from celery.utils.functional import maybe_list
from celery.worker import control

from celery_lease.errors import LeaseError

log = logging.getLogger("celery_lease")

_MARK = "_celery_lease_revoke"


def _cancel_each(cancel: Callable[[str], bool], task_ids) -> None:
    for task_id in maybe_list(task_ids) or []:
        try:
            if cancel(str(task_id)):
                log.info("celery-lease: job %s cancelled by revoke", task_id)
        except ValueError:
            pass  # not a job id: a plain task's
        except LeaseError as exc:
            log.warning("celery-lease: revoke of %s not recorded in the job table: %s", task_id, exc)


def _install_control_command() -> None:
    original = control.Panel.data["revoke"]
    if getattr(original, _MARK, False):
        return

    def revoke(state, task_id, terminate=False, signal=None, **kwargs):
        cancel = getattr(getattr(state, "app", None), "_celery_lease_cancel", None)
        if cancel is not None:
            _cancel_each(cancel, task_id)  # durable first, then Celery's (maybe kill)
        return original(state, task_id, terminate=terminate, signal=signal, **kwargs)

    setattr(revoke, _MARK, True)
    revoke.__doc__ = original.__doc__
    control.Panel.data["revoke"] = revoke


def connect(app: Celery, *, ours: Callable[[object], bool], cancel: Callable[[str], bool]) -> None:
    """Make revokes of ``app``'s leased jobs cancel them (``cancel(job_id) -> bool``)."""
    app._celery_lease_cancel = cancel
    _install_control_command()

    @signals.task_revoked.connect(weak=False)
    def on_revoked(sender=None, request=None, **_):
        if ours(sender) and request is not None:
            _cancel_each(cancel, [request.id])

    app._celery_lease_revoke_handlers = (on_revoked,)
