"""Who holds a lease: the owner a claim writes, and the boot it names.

An owner is ``node/pid/boot`` (``node/pid.T/boot`` for a claiming thread or greenlet T
other than the process's main thread). Beat's restart recovery, the worker's release of
a dead pool process's leases and the claims' adoption of a landed claim all read it, so
it is the lifecycle's, not the worker's.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
import uuid

#: Identifies this boot of the worker. Set at import in the worker's main process and
#: inherited by its pool children, so restart recovery can tell "running under this
#: node name from an earlier boot" (interrupted) from "running here now".
BOOT_ID = uuid.uuid4().hex[:12]

#: The claiming threads (or greenlets) of a threads or green pool, numbered from 1.
_claimer = threading.local()
_claimers = itertools.count(1)
_claimers_lock = threading.Lock()


def owner_of(node: str | None) -> str:
    """The lease owner written by a claim: ``node/pid/boot``, or ``node/pid.T/boot`` for
    a claim made by a thread (or greenlet) T other than the process's main thread.

    One owner claims one job at a time, so a row running under it names the thread that
    runs its body (a claim whose reply was lost finds its own rows by its claim token
    instead: lifecycle.claim.LandedClaim). Restart recovery
    matches the ``node/`` prefix and ``/boot`` suffix
    (statements.maintenance.recover_restarted); the process is ``pid`` before the dot
    (worker/dead_processes.py)."""
    pid = str(os.getpid())
    if threading.current_thread() is not threading.main_thread():
        number = getattr(_claimer, "number", None)
        if number is None:
            with _claimers_lock:
                number = _claimer.number = next(_claimers)
        pid = f"{pid}.{number}"
    return f"{node or socket.gethostname()}/{pid}/{BOOT_ID}"


def owner_pid(owner: str) -> int | None:
    """The process of a lease ``owner`` (see owner_of); None if it names none."""
    pid = owner.rsplit("/", 2)[-2].partition(".")[0] if owner.count("/") >= 2 else ""
    return int(pid) if pid.isdigit() else None
