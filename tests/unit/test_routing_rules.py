"""celery_lease.broker.routing against Celery's own routing rules (no broker is reached:
routing is worked out in Python), and the JobContext reference in docs/guide.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from celery import Celery
from celery.exceptions import QueueNotFound
from kombu import Queue

from celery_lease.broker.routing import QueueRouter, consumed_queues
from celery_lease.worker.context import JobContext

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


def test_every_public_member_of_jobcontext_is_documented():
    guide = (ROOT / "docs" / "guide.md").read_text()
    section = guide.split("## What a handler gets (`JobContext`)", 1)[1].split("\n## ", 1)[0]
    public = [name for name in vars(JobContext) if not name.startswith("_")]
    assert "submit" in public and "fencing_token" in public
    for name in public:
        assert f"`ctx.{name}" in section, name
        assert (getattr(JobContext, name).__doc__ or "").strip(), name
    assert "`ctx.staged`" in section  # an instance attribute: not in vars(JobContext)
