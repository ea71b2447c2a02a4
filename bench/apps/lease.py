"""celery-lease: the same Celery app and bodies as bench.apps.celery_plain, as leased jobs.

Claim-to-complete latency is read from the job rows (started_at is set by the claim
statement, finished_at by the completion statement, both database time). Statements
are counted by :mod:`bench.apps.counting`; each worker process writes its counts when
it exits.

BENCH_JOB_OPTIONS (JSON, optional) adds keyword arguments to every ``leases.job(...)``:
the hook for systems that differ only in job options (e.g. a future flow-controlled
``lease-pg-limited`` with ``{"concurrency": ...}``; see bench/systems.py).
"""

import atexit
import json
import os

from celery import Celery, signals

from bench.apps import BODIES, body, counting, mark_ready
from celery_lease import CeleryLease

#: Bench jobs last milliseconds; a short lease lets the bench reap (and report) a job a
#: worker left running within seconds instead of a minute (run.wait_completed).
LEASE_SECONDS = 5


def _job(leases: CeleryLease, name: str, options: dict, body_name: str | None = None):
    @leases.job(kind=name, name=f"bench.lease.{name}", **{"lease_seconds": LEASE_SECONDS, **options})
    def run(ctx, payload):
        body(body_name or name)

    return run


def make_app(db: str | None, broker: str | None, job_options: dict | None = None, **settings):
    """(app, leases, {body: task}) for one database; the bench makes one per system.

    ``settings`` are CeleryLease settings (e.g. ``sweep_stale_seconds`` for the scale run).
    """
    app = Celery("bench_lease", broker=broker or "memory://")
    app.conf.update(
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        task_ignore_result=True,
    )
    leases = CeleryLease(app, db, install_beat=False, **settings)
    tasks = {name: _job(leases, name, job_options or {}) for name in BODIES}
    # Flow control (python -m bench flow): no-op bodies behind limits they never reach,
    # so what differs from noop is only the cost of the limit at claim and release.
    tasks["noop_limited"] = _job(leases, "noop_limited", {"concurrency": 64}, body_name="noop")
    tasks["noop_rated"] = _job(leases, "noop_rated", {"rate_limit": "100000/s"}, body_name="noop")
    # The handover of one slot: each job waits for the previous one's release.
    tasks["noop_one"] = _job(leases, "noop_one", {"concurrency": 1}, body_name="noop")
    # Fair share (python -m bench fair): one tenant's backlog, and 10,000 tenants'.
    for name in ("noop_fair", "noop_fair_many"):
        tasks[name] = _job(leases, name, {"fair": True}, body_name="noop")
    return app, leases, tasks


# The worker's app (`celery -A bench.apps.lease worker`), from the environment.
app, leases, tasks = make_app(
    os.environ.get("BENCH_DB"), os.environ.get("BENCH_BROKER"), json.loads(os.environ.get("BENCH_JOB_OPTIONS") or "{}")
)

# Pool children leave through worker_process_shutdown; the main process through atexit.
signals.worker_process_shutdown.connect(lambda **_: counting.dump(), weak=False)
atexit.register(counting.dump)


@signals.worker_ready.connect
def _ready(**_):
    mark_ready()
