"""The broker layer without a broker: celery_lease.broker.routing against Celery's own
routing rules (routing is worked out in Python), and what a cancel notice must look
like and whom it wakes (broker/cancel_notice.py)."""

from __future__ import annotations

import json
import re
import time
import uuid
from pathlib import Path

import pytest
from celery import Celery
from celery.exceptions import QueueNotFound
from kombu import Queue

from celery_lease.broker import cancel_notice
from celery_lease.broker.routing import QueueRouter, consumed_queues

ROOT = Path(__file__).resolve().parents[2]


class ByRegion:
    """A router class, as task_routes may hold one."""

    def __call__(self, name, args, kwargs, options, task=None, **_):
        if name == "shop.ship" and args and args[0]:
            return {"queue": f"ship-{args[0]['region']}"}
        return None


def _app(routes, **conf) -> Celery:
    app = Celery("shop", broker="memory://", set_as_current=False)
    app.conf.update(task_routes=routes, task_default_queue="work", **conf)

    @app.task(name="shop.pinned", queue="pinned", shared=False, lazy=False)
    def pinned():  # a task's own queue beats task_routes, as in Celery
        pass

    return app


def test_the_queue_is_celerys_answer_for_each_kind_of_route():
    routes = [ByRegion(), {re.compile(r"shop\.rep.*"): "reports", "shop.mail*": {"queue": "mail"}, "shop.exact": "exact"}]
    router = QueueRouter(_app(routes))
    assert router.queue("shop.ship", None, {"region": "eu"}) == "ship-eu"  # router class, reading the payload
    assert router.queue("shop.report", None, {}) == "reports"  # compiled regex, bare queue name
    assert router.queue("shop.mailer", None, {}) == "mail"  # glob
    assert router.queue("shop.exact", None, {}) == "exact"
    assert router.queue("shop.other", None, {}) == "work"  # no route: the default queue
    assert router.queue("shop.mailer", "urgent", {}) == "urgent"  # the call's queue= wins
    assert router.queue("shop.pinned", None, {}) == "pinned"  # the task's own beats the glob below
    assert QueueRouter(_app({"shop.pinned": "routed"})).queue("shop.pinned", None, {}) == "pinned"


def test_dict_routes_are_cached_but_a_reconfigured_app_is_asked_again():
    app = _app({"shop.report": "reports"})
    router = QueueRouter(app)
    assert router.queue("shop.report", None, {}) == "reports"
    app.conf.task_routes = {"shop.report": "elsewhere"}
    app.amqp.flush_routes()  # Celery reads task_routes once; a new Router is new routes
    app.amqp.__dict__.pop("router", None)
    assert router.queue("shop.report", None, {}) == "elsewhere"


def test_an_exchange_only_route_stores_no_queue_and_an_unknown_queue_is_refused():
    assert QueueRouter(_app({"shop.fan": {"exchange": "fan", "routing_key": "x"}})).queue("shop.fan", None, {}) is None
    strict = _app({}, task_create_missing_queues=False, task_queues=[Queue("work")])
    with pytest.raises(QueueNotFound):
        QueueRouter(strict).queue("shop.any", "nowhere", {})


def test_a_worker_consumes_every_queue_the_app_names():
    app = _app([ByRegion(), {"shop.rep*": "reports", "shop.mail": {"queue": "mail"}}], task_queues=[Queue("work"), Queue("bulk")])
    assert consumed_queues(app, ["pinned", None, "reports"]) == ["work", "bulk", "mail", "reports", "pinned"]


# --- cancel notices ----------------------------------------------------------------------

ID = "6f1c2c9e-0b0e-4a53-9d6a-3b1f7d2b8c11"


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"not json",
        b'"6f1c2c9e-0b0e-4a53-9d6a-3b1f7d2b8c11"',
        b"{}",
        b"[]",
        json.dumps([ID, 1]).encode(),
        json.dumps([ID, "x" * 36]).encode(),
        json.dumps(["{" + ID[:-2] + "}"]).encode(),
        json.dumps([ID] * (cancel_notice.MAX_IDS + 1)).encode(),
        json.dumps([ID]).encode() + b" " * cancel_notice.MAX_NOTICE_BYTES,
        None,
        12,
    ],
)
def test_malformed_cancel_notices_name_no_job(data):
    assert cancel_notice.parse(data) is None


def test_a_well_formed_notice_names_its_jobs():
    assert cancel_notice.parse(json.dumps([ID.upper(), ID]).encode()) == {ID}
    assert cancel_notice.parse(json.dumps([ID])) == {ID}


def test_a_listener_wakes_only_for_held_jobs_and_at_a_bounded_rate():
    wakes = []
    listener = cancel_notice.Listener(lambda: wakes.append(1), held=lambda: {ID})
    assert not listener.handle(json.dumps([str(uuid.uuid4())]).encode())  # held by nobody here
    assert not listener.handle(b"junk")
    assert wakes == [] and listener.ignored == 2
    started = time.monotonic()
    for _ in range(cancel_notice.WAKE_BURST * 5):
        listener.handle(json.dumps([ID, str(uuid.uuid4())]).encode())
    elapsed = time.monotonic() - started
    # The burst at once, then no more than the rate allows for the time it took.
    assert cancel_notice.WAKE_BURST <= len(wakes) <= cancel_notice.WAKE_BURST + cancel_notice.WAKE_RATE * elapsed + 1
    assert listener.dropped == cancel_notice.WAKE_BURST * 5 - len(wakes)


def test_notice_channels_are_per_app_and_per_database():
    a = cancel_notice.channel("redis://h:6379/0", "shop")
    assert a == "celery-lease:cancelled:0:shop"
    assert cancel_notice.channel("redis://h:6379/3", "shop") != a
    assert cancel_notice.channel("redis://h:6379/0", "other") != a
    assert cancel_notice.channel("redis://h:6379", None) == "celery-lease:cancelled:0:celery"
    assert cancel_notice.channel("redis://h:6379/0?db=0", "a b:c") == "celery-lease:cancelled:0:a_b_c"
