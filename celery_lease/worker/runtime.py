"""The worker's background threads (completer, timeouts, revoker, heartbeat) are each a
:class:`Drainer`: one daemon thread per process, started by its first piece of work.
Per process: Celery's prefork pool forks children after the parent may have started
one, and a thread does not survive fork. Daemon: no exit waits on one (warm exits flush
first), nor on one stuck on the database. ``threading`` is read at call time, never
bound at import: in a gevent or eventlet worker, patched first, they are greenlets.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

log = logging.getLogger("celery_lease.worker")


class Drainer:
    """Producers change the state under ``_cond``, :meth:`_start` and notify; the thread
    does what :meth:`_next` finds ready in :meth:`_drain`, without the lock."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._cond = threading.Condition()
        self._pid = 0  # of the process that started the thread (none is 0)

    @property
    def running(self) -> bool:
        """Whether this process started its thread (a forked child has not)."""
        return self._pid == os.getpid()

    def _start(self) -> bool:
        """Under ``_cond``: start this process's thread unless it runs; True if started now."""
        if self.running:
            return False
        self._pid = os.getpid()
        threading.Thread(target=self._run, name=self._name, daemon=True).start()
        return True

    def _next(self) -> tuple[Any, float | None]:
        """``(work, None)``, or ``(None, seconds to wait)`` (None: until notified)."""
        raise NotImplementedError

    def _drain(self, work: Any) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while True:
            with self._cond:
                work, wait = self._next()
                while work is None:
                    self._cond.wait(wait)
                    work, wait = self._next()
            try:
                self._drain(work)
            except Exception:  # the thread outlives any round: no other takes its place
                log.exception("celery-lease: %s: a round failed", self._name)
