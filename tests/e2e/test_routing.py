"""Celery's routing decides a job's queue: real workers started with ``-Q`` consuming
only routed queues (tests/apps/app_routing.py: a task_routes glob, a router function
that reads the payload, a decorator's queue=), Redis holding the wakeups."""

from __future__ import annotations

import json
import time

import redis
from celery import chain

from celery_lease import Status
from tests.conftest import wait_for

MODULE = "tests.apps.app_routing"


def _queued(broker: str, queue: str) -> list[str]:
    """The job ids of the wakeups waiting in a Redis queue."""
    client = redis.Redis.from_url(broker)
    try:
        return [json.loads(m)["headers"]["id"] for m in client.lrange(queue, 0, -1)]
    finally:
        client.close()


def test_each_job_is_stored_and_run_on_the_queue_celery_routes_it_to(pg, broker, client_app, workers):
    mod = client_app(pg, broker, module=MODULE)
    workers(pg, broker, module=MODULE, queues="routed,pinned,tenant-a", concurrency=1)

    routed = mod.routed_echo.submit({"value": 1})  # task_routes glob
    delayed = mod.leases.get(mod.routed_echo.delay({"value": 2}).id)  # Celery's call, same routes
    pinned = mod.routed_pinned.submit({})  # @leases.job(queue=...) wins over the glob
    tenant = mod.tenant_echo.submit({"tenant": "a"})  # a router function reading the payload
    given = mod.echo.apply_async(({"value": 3},), queue="routed")  # queue= of the call
    many = mod.tenant_echo.submit_many([{"tenant": "a"}, {"tenant": "b"}, {"tenant": "a"}])
    plain = mod.echo.submit({"value": 4})  # no route: the default queue, which no worker consumes
    # A chain's next step is created by the worker with the previous step's success,
    # routed as its own task (the router reads the step's payload there).
    last = chain(mod.routed_echo.s({"value": 5}), mod.tenant_echo.si({"tenant": "a"})).apply_async()

    expected = {
        routed.id: "routed",
        delayed.id: "routed",
        pinned.id: "pinned",
        tenant.id: "tenant-a",
        given.id: "routed",
        many[0].id: "tenant-a",
        many[2].id: "tenant-a",
        last.parent.id: "routed",
        last.id: "tenant-a",
    }
    for job_id, queue in expected.items():
        done = mod.leases.wait(job_id, timeout=60)
        assert (done.status, done.queue) == (Status.SUCCEEDED, queue), job_id
    # Stored where they were sent: the other tenant's job and the plain one wait in
    # their own queues, untouched by a worker that does not consume them.
    assert [mod.leases.get(j.id).queue for j in (many[1], plain)] == ["tenant-b", "celery"]
    assert [mod.leases.get(j.id).status for j in (many[1], plain)] == [Status.PENDING] * 2
    assert _queued(broker, "tenant-b") == [many[1].id] and _queued(broker, "celery") == [plain.id]


def test_the_sweeper_resends_a_lost_wakeup_to_the_jobs_routed_queue(pg, broker, client_app, workers):
    # The router function needs the payload, which a re-sent wakeup does not carry: only
    # the queue stored at submit can send it to the right place.
    mod = client_app(pg, broker, module=MODULE, conf={"lease_sweep_stale_seconds": 1})
    job = mod.tenant_echo.submit({"tenant": "a"})
    assert _queued(broker, "tenant-a") == [job.id]
    client = redis.Redis.from_url(broker)
    try:
        client.delete("tenant-a")  # the wakeup is lost (a broker failover, a flushed key)
    finally:
        client.close()
    time.sleep(1.2)  # past the staleness threshold
    assert mod.leases.sweep() == 1
    assert _queued(broker, "tenant-a") == [job.id] and _queued(broker, "celery") == []
    workers(pg, broker, module=MODULE, queues="tenant-a", concurrency=1)
    done = mod.leases.wait(job.id, timeout=60)
    assert (done.status, done.result) == (Status.SUCCEEDED, {"tenant": "a"})


def test_a_retry_is_woken_on_the_routed_queue(pg, broker, client_app, workers):
    # A retry with backoff is a job due later, woken by the sweeper (beat's tick, run
    # here by the test) when due: on the stored queue, the only one this worker consumes.
    mod = client_app(pg, broker, module=MODULE)
    workers(pg, broker, module=MODULE, queues="tenant-a", concurrency=1)
    job = mod.tenant_echo.submit({"tenant": "a", "fail_first": True})

    def succeeded():
        mod.leases.sweep()
        return mod.leases.get(job.id).status is Status.SUCCEEDED

    wait_for(succeeded, timeout=60, interval=0.3, what="the retried job to succeed")
    assert mod.leases.get(job.id).attempt == 2
