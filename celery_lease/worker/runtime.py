"""The worker's background threads (completer, timeouts, revoker, heartbeat): each a
:class:`Drainer`, one daemon thread per process started by its first piece of work.

Fork safety: Celery's prefork pool forks children after the parent may have started
these threads, and a thread does not survive fork; so a thread belongs to the pid that
started it, and a child starts its own on first use. Daemon: no exit waits on one (warm
exits flush what must be written first) and one stuck on the database holds no process
up. ``threading`` is read at call time, never bound at import: in a gevent or eventlet
worker the thread and its condition are then the hub's greenlet and lock (green.py).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

log = logging.getLogger("celery_lease.worker")


class Drainer:
    """Producers change the state under ``_cond``, call :meth:`_start` and notify; the
    thread takes what :meth:`_next` finds ready (under ``_cond``) and does it in
    :meth:`_drain` (without the lock: a producer never waits on the database)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._pid = 0

    @property
    def running(self) -> bool:
        """Whether this process started its thread (a forked child has not)."""
        return self._thread is not None and self._pid == os.getpid()

    def _start(self) -> bool:
        """Under ``_cond``: start this process's thread unless it runs; True if started now."""
        if self.running:
            return False
        self._pid = os.getpid()
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()
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
