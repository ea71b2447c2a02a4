"""celery-lease: the same Celery app and bodies as bench.apps.celery_plain, as leased jobs.

Claim-to-complete latency is read from the job rows (started_at is set by the claim
statement, finished_at by the completion statement, both database time). Statements
are counted by :mod:`bench.apps.counting`; each worker process writes its counts when
it exits.
"""

import atexit
import os

from celery import Celery, signals

from bench.apps import body, counting, mark_ready
from celery_lease import CeleryLease


def make_app(db: str | None, broker: str | None):
    """(app, leases, {body: task}) for one database; the bench makes one per system."""
    app = Celery("bench_lease", broker=broker or "memory://")
    app.conf.update(
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        task_ignore_result=True,
    )
    leases = CeleryLease(app, db, install_beat=False)

    @leases.job(kind="noop", name="bench.lease.noop")
    def noop(ctx, payload):
        body("noop")

    @leases.job(kind="sleep10", name="bench.lease.sleep10")
    def sleep10(ctx, payload):
        body("sleep10")

    # Flow control (python -m bench flow): no-op bodies behind limits they never reach,
    # so what differs from noop is only the cost of the limit at claim and release.
    @leases.job(kind="noop_limited", name="bench.lease.noop_limited", concurrency=64)
    def noop_limited(ctx, payload):
        body("noop")

    @leases.job(kind="noop_rated", name="bench.lease.noop_rated", rate_limit="100000/s")
    def noop_rated(ctx, payload):
        body("noop")

    return app, leases, {"noop": noop, "sleep10": sleep10, "noop_limited": noop_limited, "noop_rated": noop_rated}


# The worker's app (`celery -A bench.apps.lease worker`), from the environment.
app, leases, tasks = make_app(os.environ.get("BENCH_DB"), os.environ.get("BENCH_BROKER"))

# Pool children leave through worker_process_shutdown; the main process through atexit.
signals.worker_process_shutdown.connect(lambda **_: counting.dump(), weak=False)
atexit.register(counting.dump)


@signals.worker_ready.connect
def _ready(**_):
    mark_ready()
