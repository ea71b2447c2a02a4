"""Celery's revoke, on a leased job, is a durable cancel of the job (docs/lifecycle.md).

Celery keeps revoked ids in memory only, so a revoked leased job would stay pending with
every wakeup discarded. The worker's ``revoke`` control command therefore also cancels the
jobs it names in their rows (the ``revoke`` transition, as ``leases.cancel``), then does
what Celery does. The rules: only a revoke by id of one of this app's leased tasks
cancels, never Celery's ``task_revoked`` signal; the consumer only queues the ids and a
:class:`Revoker` thread cancels them, one statement per round; a cancel not written within
GIVE_UP seconds is given up and its id taken out of Celery's revoked ids again, so the
job's next wakeup runs it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from celery import Celery, signals
from celery.utils.collections import LimitedSet
from celery.utils.functional import maybe_list
from celery.worker import control
from celery.worker import state as worker_state

from celery_lease import results
from celery_lease.errors import LeaseError
from celery_lease.job import parse_job_id
from celery_lease.worker.runtime import Drainer

log = logging.getLogger("celery_lease")

_MARK = "_celery_lease_revoke"


class Revoker(Drainer):
    """Cancels revoked job ids on its own thread, all queued ids in one statement."""

    #: Ids per statement (SQLite binds each id as one parameter).
    MAX_PER_STATEMENT = 5000
    #: Seconds between tries while the database refuses (down, or a row lock held past
    #: the transition's lock timeout); an id is given up after GIVE_UP seconds.
    RETRY = 1.0
    GIVE_UP = 120.0

    def __init__(self, cancel: Callable[[list[str]], list[str]]) -> None:
        super().__init__("celery-lease-revoke")
        #: cancel(ids) -> the ids cancelled.
        self._cancel = cancel
        #: Ids a revoke command named (as long as Celery remembers revoked ids).
        self.named = LimitedSet(maxlen=50_000, expires=3 * 3600)
        self._ids: dict[str, float] = {}  # id -> monotonic time first queued

    def submit(self, task_ids: object) -> None:
        """Queue the job ids among ``task_ids``; returns at once (the consumer's thread)."""
        ids = []
        for task_id in maybe_list(task_ids) or []:
            self.named.add(str(task_id))
            try:
                ids.append(parse_job_id(str(task_id)))
            except ValueError:
                pass  # not a job id: a plain task's
        if not ids:
            return
        now = time.monotonic()
        with self._cond:
            self._start()
            for job_id in ids:
                self._ids.setdefault(job_id, now)
            self._cond.notify()

    def _next(self) -> tuple[dict[str, float] | None, None]:
        taken = dict(list(self._ids.items())[: self.MAX_PER_STATEMENT])
        for job_id in taken:
            del self._ids[job_id]
        return taken or None, None

    def _drain(self, taken: dict[str, float]) -> None:
        try:
            done = self._cancel(list(taken))
            if done:
                log.info("celery-lease: %d job(s) cancelled by revoke", len(done))
        except LeaseError as exc:
            now = time.monotonic()
            kept = {i: t for i, t in taken.items() if now - t < self.GIVE_UP}
            log.warning(
                "celery-lease: revoke of %d id(s) not recorded in the job table yet (%s); %d kept",
                len(taken),
                type(exc).__name__,
                len(kept),
            )
            with self._cond:
                for job_id, since in kept.items():
                    self._ids.setdefault(job_id, since)
            self._forget([i for i in taken if i not in kept])
            time.sleep(self.RETRY)
        except Exception:
            log.exception("celery-lease: revoke of %d id(s) not recorded in the job table", len(taken))
            self._forget(list(taken))

    def _forget(self, ids: list[str]) -> None:
        """Revokes whose cancel did not happen no longer block their jobs. Celery keeps a
        revoked id in memory (3 h) and discards every delivery of it meanwhile: the
        sweeper's wakeups of a job whose row, the truth, is still pending would all be
        dropped, on every worker that got the broadcast. Each of them runs its own
        Revoker and gives up on its own clock, so each forgets the id itself."""
        for job_id in ids:
            worker_state.revoked.discard(job_id)
            self.named.discard(job_id)
        if ids:
            log.warning("celery-lease: revoke of %d job(s) given up; their wakeups run them again", len(ids))


def _install_control_command() -> None:
    original = control.Panel.data["revoke"]
    if getattr(original, _MARK, False):
        return

    def revoke(state, task_id, terminate=False, signal=None, **kwargs):
        revoker = getattr(getattr(state, "app", None), "_celery_lease_revoker", None)
        if revoker is None:
            return original(state, task_id, terminate=terminate, signal=signal, **kwargs)
        revoker.submit(task_id)  # queued: the consumer never waits on the database
        with results.reads_skipped():  # on the consumer: no job row read per id
            return original(state, task_id, terminate=terminate, signal=signal, **kwargs)

    setattr(revoke, _MARK, True)
    revoke.__doc__ = original.__doc__
    control.Panel.data["revoke"] = revoke


def connect(app: Celery, *, ours: Callable[[object], bool], cancel_ids: Callable[[list[str]], list[str]]) -> None:
    """Make revokes of ``app``'s leased jobs cancel them (``cancel_ids(ids) -> ids cancelled``:
    only jobs of the app's leased tasks)."""
    revoker = app._celery_lease_revoker = Revoker(cancel_ids)
    _install_control_command()

    @signals.task_revoked.connect(weak=False)
    def on_expired(sender=None, request=None, expired=False, **_):
        # Never a cancel: Celery also sends task_revoked for a message that merely expired,
        # and any sender writes ``expires``, so acting on it would let any message cancel
        # any job. Only forget the id Celery's expiry check added to its revoked ids (it
        # would discard every later wakeup); the sweeper's next wakeup runs the job.
        if expired and request is not None and ours(sender) and request.id not in revoker.named:
            worker_state.revoked.discard(request.id)
            log.info("celery-lease: expired wakeup of job %s discarded; the job is left as it is", request.id)

    app._celery_lease_revoke_handlers = (on_expired,)
