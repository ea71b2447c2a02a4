"""Warm shutdown: the flag every handler's stop point reads.

Set by the worker's main process (``worker_shutting_down`` with ``how="Warm"``); it lives
in shared memory created at import, before the pool forks, so every prefork child sees
it at once without a signal. A handler then stops at its next ``raise_if_cancelled()``
and its job is handed off: back to pending at once, no attempt spent.
"""

from __future__ import annotations

import multiprocessing

_FLAG = multiprocessing.RawValue("b", 0)


def request() -> None:
    _FLAG.value = 1


def requested() -> bool:
    return bool(_FLAG.value)


def reset() -> None:
    """For tests that run several worker lifetimes in one process."""
    _FLAG.value = 0
