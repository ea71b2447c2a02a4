"""Green pools (``celery worker -P gevent`` / ``-P eventlet``): the job database's driver
made cooperative with the hub (docs/guide.md, "gevent and eventlet").

psycopg2 talks to PostgreSQL in C, which Celery's monkey-patching does not reach: without
a wait callback every statement blocks the whole process, the heartbeat greenlet included,
and the other jobs' leases lapse. :func:`cooperate` installs psycopg2's wait callback (the
psycogreen recipe), so each statement yields to the hub while it waits, and rebinds to the
hub's ``sleep`` the modules that bound the blocking one before the hub patched ``time``.
The rule: an installed wait callback (eventlet's, psycogreen's, the application's) is
left as it is. In green mode psycopg2 does not run COPY.
"""

from __future__ import annotations

import sys
from typing import Any


def hub() -> str | None:
    """``"gevent"`` or ``"eventlet"`` when this process's sockets are monkey-patched by
    it (as ``celery worker -P gevent|eventlet`` does before anything else), else None."""
    monkey = sys.modules.get("gevent.monkey")
    if monkey is not None and monkey.is_module_patched("socket"):
        return "gevent"
    patcher = sys.modules.get("eventlet.patcher")
    if patcher is not None and patcher.is_monkey_patched("socket"):
        return "eventlet"
    return None


def cooperate() -> str | None:
    """Make psycopg2 yield to this process's green hub; returns the hub's name (None:
    not a green process, nothing done). Idempotent."""
    name = hub()
    if name is None:
        return None
    _green_sleeps(name)
    try:
        from psycopg2 import extensions
    except ImportError:  # SQLite only: nothing to make green
        return name
    if extensions.get_wait_callback() is None:
        extensions.set_wait_callback(_gevent_wait if name == "gevent" else _eventlet_wait)
    return name


def _green_sleeps(name: str) -> list[str]:
    """Rebind to the hub's sleep the ``sleep`` of every loaded module that holds the
    blocking one (bound before the hub patched ``time``); returns their names. The
    hubs' own modules keep theirs (they block on purpose, off the hub). One such module
    is kombu's (``retry_over_time``, Celery's broker reconnect): left blocking, a broker
    restart froze every greenlet, the heartbeat too, and the jobs' leases lapsed."""
    import time

    if name == "gevent":
        from gevent import monkey

        blocking = monkey.get_original("time", "sleep")
    else:
        from eventlet import patcher

        blocking = patcher.original("time").sleep
    if time.sleep is blocking:  # time itself not patched: nothing is green
        return []
    rebound = []
    for module_name, module in list(sys.modules.items()):
        if module_name.startswith(("gevent", "eventlet", "greenlet", "__original")) or module_name == "time":
            continue
        if getattr(module, "sleep", None) is blocking:
            vars(module)["sleep"] = time.sleep
            rebound.append(module_name)
    return rebound


def _gevent_wait(conn: Any, timeout: float | None = None) -> None:
    from gevent.socket import wait_read, wait_write

    _wait(conn, wait_read, wait_write)


def _eventlet_wait(conn: Any, timeout: float | None = None) -> None:
    from eventlet.hubs import trampoline

    _wait(conn, lambda fd: trampoline(fd, read=True), lambda fd: trampoline(fd, write=True))


def _wait(conn: Any, wait_read: Any, wait_write: Any) -> None:
    from psycopg2 import OperationalError, extensions

    while True:
        state = conn.poll()
        if state == extensions.POLL_OK:
            return
        if state == extensions.POLL_READ:
            wait_read(conn.fileno())
        elif state == extensions.POLL_WRITE:
            wait_write(conn.fileno())
        else:
            raise OperationalError(f"unexpected poll state {state}")
