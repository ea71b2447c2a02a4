"""The pipeline's Celery app, configured from the environment.

``CELERY_LEASE_DATABASE_URL``  the job database (also holds staging and destination
                               tables); unset: ``celery-lease.sqlite3`` here
``CELERY_BROKER_URL``          the broker (Celery reads it); unset: local Redis.
                               ``filesystem://`` needs no server: messages are files
                               in ``TASKS_BROKER_FOLDER`` (default ``.demo/broker``)
``TASKS_LEASE_SECONDS``        lease of every pipeline job (default 60)
"""

from __future__ import annotations

import os

from celery import Celery

from celery_lease import CeleryLease

BROKER_URL = os.environ.get("CELERY_BROKER_URL", "redis://127.0.0.1:6379/0")

#: A job whose worker dies is reaped once its lease elapses, so the lease bounds how
#: long such a job waits; heartbeats renew it every third of it while the job runs.
LEASE_SECONDS = int(os.environ.get("TASKS_LEASE_SECONDS", "60"))

app = Celery("tasks", broker=BROKER_URL)
app.conf.update(
    broker_connection_retry_on_startup=True,
    # Wakeups are tiny and jobs are long: a worker reserving many wakeups only delays
    # them (a reserved wakeup lost with its worker waits for the sweeper).
    worker_prefetch_multiplier=1,
    task_default_queue="celery",
    # Flower and `celery events` see every job under its job id.
    worker_send_task_events=True,
    task_send_sent_event=True,
)
if BROKER_URL.startswith("filesystem://"):
    _folder = os.path.abspath(os.environ.get("TASKS_BROKER_FOLDER", os.path.join(".demo", "broker")))
    for _sub in ("queue", "processed", "control"):
        os.makedirs(os.path.join(_folder, _sub), exist_ok=True)
    app.conf.broker_transport_options = {
        # One folder for in and out: producers and workers share the same queue files.
        "data_folder_in": os.path.join(_folder, "queue"),
        "data_folder_out": os.path.join(_folder, "queue"),
        "processed_folder": os.path.join(_folder, "processed"),
        "control_folder": os.path.join(_folder, "control"),
        # The transport polls its folder; Celery's 1 s default would add a second
        # to every hop of the pipeline.
        "polling_interval": 0.1,
    }
    # kombu's filesystem transport, minus a consumer that stops at an empty file.
    app.conf.broker_transport = "tasks.filesystem_broker:Transport"

leases = CeleryLease(app)

from tasks import pipeline  # noqa: E402,F401  (registers the job kinds on `leases`)
