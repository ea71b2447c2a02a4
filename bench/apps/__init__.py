"""The worker-side apps, one module per system, each run in its own process.

All are configured from the environment: BENCH_BROKER (Redis URL), BENCH_DB (database
URL) and BENCH_OUT (a directory for per-process records and the ready marker).
Every system runs the same two bodies: ``noop`` (returns at once) and ``sleep10``
(``time.sleep(0.01)``, a blocking call as in real handlers).
"""

import os
import time
from pathlib import Path

SLEEP_SECONDS = 0.01


def body(name: str) -> None:
    if name == "sleep10":
        time.sleep(SLEEP_SECONDS)


def mark_ready() -> None:
    """Tell the bench this worker's process is up (its log level hides Celery's own line)."""
    Path(os.environ["BENCH_OUT"], "ready").touch()
