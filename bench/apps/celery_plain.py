"""Plain Celery: the baseline. Same broker, pool, concurrency and bodies as celery-lease.

Claim-to-complete latency here is task_prerun -> task_postrun, taken in the pool child
with time.time(); the message was acked before the body (acks_late is off, Celery's
default, as for LeaseTask). Each child appends one fixed-width line per task to its own
file, which is also how the bench counts completions without touching the broker.
"""

import os
import time

from celery import Celery, signals

from bench.apps import BODIES, body, mark_ready


def _task(app: Celery, name: str):
    @app.task(name=f"bench.{name}")
    def run():
        body(name)

    return run


def make_app(broker: str | None):
    """(app, {body: task}); the bench makes its own producer app the same way."""
    app = Celery("bench_plain", broker=broker or "memory://")
    app.conf.update(
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        task_ignore_result=True,
    )
    return app, {name: _task(app, name) for name in BODIES}


app, tasks = make_app(os.environ.get("BENCH_BROKER"))
_started: dict[str, float] = {}
_records = None


@signals.task_prerun.connect
def _prerun(task_id=None, **_):
    _started[task_id] = time.time()


@signals.task_postrun.connect
def _postrun(task_id=None, **_):
    global _records
    if _records is None:
        _records = open(os.path.join(os.environ["BENCH_OUT"], f"records-{os.getpid()}.txt"), "a", buffering=1)
    _records.write(f"{_started.pop(task_id, 0.0):.6f} {time.time():.6f}\n")


@signals.worker_ready.connect
def _ready(**_):
    mark_ready()
