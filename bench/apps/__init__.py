"""The worker-side apps, one module per system, each run in its own process.

All are configured from the environment: BENCH_BROKER (Redis URL), BENCH_DB (database
URL) and BENCH_OUT (a directory for per-process records and the ready marker).
Every system runs the same three bodies: ``noop`` (returns at once), ``sleep1`` and
``sleep10`` (``time.sleep(0.001)`` and ``time.sleep(0.01)``, blocking calls as in real
handlers).
"""

import os
import time
from pathlib import Path

#: Every body the bench runs, and how long each one blocks.
SLEEP_SECONDS = {"noop": 0.0, "sleep1": 0.001, "sleep10": 0.01}
BODIES = tuple(SLEEP_SECONDS)


def body(name: str) -> None:
    seconds = SLEEP_SECONDS[name]
    if seconds:
        time.sleep(seconds)


def mark_ready() -> None:
    """Tell the bench this worker's process is up (its log level hides Celery's own line)."""
    Path(os.environ["BENCH_OUT"], "ready").touch()
