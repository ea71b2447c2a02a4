"""The Django project's web side, as a process of its own: ``python -m
tests.apps.djangoproj.drive SCENARIO`` prints one JSON object with what it saw.

atomic   submits (on the queue "held", which no worker consumes) inside
         ``transaction.atomic()`` beside an ORM write; reports what another connection
         and the broker saw inside the block, after a rollback and after a commit
tasks    enqueues ``django.tasks`` tasks (one inside a rolled-back atomic block) and
         waits for a worker to run them, reading results with ``refresh()``
"""

from __future__ import annotations

import json
import sys
import time

import django

django.setup()

import redis  # noqa: E402
from django.db import transaction  # noqa: E402

from tests.apps.djangoproj.celery import app, leases  # noqa: E402
from tests.apps.djangoproj.shop import tasks  # noqa: E402
from tests.apps.djangoproj.shop.models import Order  # noqa: E402


class Rollback(Exception):
    pass


def held_wakeups() -> int:
    client = redis.Redis.from_url(app.conf.broker_url)
    try:
        return int(client.llen("held"))
    finally:
        client.close()


def atomic() -> dict:
    seen: dict = {"settings": {"sweep_stale_seconds": leases.settings.sweep_stale_seconds}}
    try:
        with transaction.atomic():
            Order.objects.create(reference="rolled-back")
            job = tasks.fulfil.submit({"reference": "rolled-back"}, queue="held")
            seen["rollback_inside"] = {"row_elsewhere": leases.get(job.id) is not None, "wakeups": held_wakeups()}
            raise Rollback
    except Rollback:
        pass
    seen["rollback_after"] = {
        "row": leases.get(job.id) is not None,
        "order": Order.objects.filter(reference="rolled-back").exists(),
        "wakeups": held_wakeups(),
    }
    with transaction.atomic():
        Order.objects.create(reference="committed")
        job = tasks.fulfil.submit({"reference": "committed"}, queue="held")
        with transaction.atomic():  # a savepoint: still the outer transaction
            nested = tasks.fulfil.submit({"reference": "nested"}, queue="held")
        seen["commit_inside"] = {
            "row_elsewhere": leases.get(job.id) is not None or leases.get(nested.id) is not None,
            "wakeups": held_wakeups(),
        }
    seen["commit_after"] = {"rows": [leases.get(j.id).status.value for j in (job, nested)], "wakeups": held_wakeups()}
    # Outside any atomic block the submit commits by itself, at once.
    alone = tasks.fulfil.submit({"reference": "alone"}, queue="held")
    seen["autocommit"] = {"row": leases.get(alone.id) is not None, "wakeups": held_wakeups()}
    return seen


def run_tasks() -> dict:
    if sys.version_info >= (3, 12):
        from django.tasks.exceptions import TaskResultDoesNotExist
    else:
        from django_tasks.exceptions import TaskResultDoesNotExist

    seen: dict = {}
    try:
        with transaction.atomic():
            lost = tasks.add.enqueue(1, 1)
            raise Rollback
    except Rollback:
        pass
    try:
        tasks.add.get_result(lost.id)
        seen["rolled_back_result"] = "found"
    except TaskResultDoesNotExist:
        seen["rolled_back_result"] = "does not exist"
    results = {"add": tasks.add.enqueue(2, 3), "retried": tasks.attempt_of.enqueue(True), "fails": tasks.always_fails.enqueue()}
    seen["enqueued_status"] = results["add"].status.value
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(r.is_finished for r in results.values()):
        time.sleep(0.2)
        for r in results.values():
            r.refresh()
    for name, r in results.items():
        seen[name] = {
            "status": r.status.value,
            "value": r.return_value if r.status.value == "SUCCESSFUL" else None,
            "attempts": r.attempts,
            "errors": [e.traceback for e in r.errors],
            "job_status": leases.get(r.id).status.value,
        }
    return seen


if __name__ == "__main__":
    scenario = {"atomic": atomic, "tasks": run_tasks}[sys.argv[1]]
    print(json.dumps(scenario()))
