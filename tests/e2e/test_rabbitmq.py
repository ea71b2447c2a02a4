"""RabbitMQ as the broker: wakeups through kombu's AMQP transport, cancel notices over a
fanout exchange, beat's maintenance ticks, and (tests/e2e/test_chaos.py) the fault
scenario with the broker itself SIGKILLed and restarted.

Each test runs on a throwaway vhost of a private node (tests/harness/rabbitmq.py), never
on the shared RabbitMQ.
"""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from kombu import Connection

from celery_lease import Status
from celery_lease.broker import cancel_notice
from celery_lease.broker.redis_direct import RedisDirect
from tests.conftest import wait_for
from tests.e2e.test_faults import LONG, beat_reaps_and_sweeps, pid_in


@pytest.fixture
def db(pg):
    engine = sa.create_engine(pg)
    yield engine
    engine.dispose()


def _queued(broker_url: str, queue: str) -> list:
    """Every message waiting in ``queue``, taken off it (acknowledged)."""
    out = []
    with Connection(broker_url) as conn:
        simple = conn.SimpleQueue(queue)
        try:
            while True:
                message = simple.get(block=True, timeout=1)
                out.append(message)
                message.ack()
        except simple.Empty:
            pass
        finally:
            simple.close()
    return out


def test_wakeups_go_through_kombus_amqp_transport(pg, amqp_broker, client_app, workers):
    conf = {"lease_sweep_stale_seconds": 2}
    mod = client_app(pg, amqp_broker.url, conf=conf)
    with mod.app.producer_or_acquire() as producer:
        assert type(producer.channel).__module__ == "kombu.transport.pyamqp"
        assert RedisDirect.of(producer) is None  # the direct Redis path is for Redis only
    one = mod.echo.submit({"value": 1})
    many = mod.echo.submit_many([{"value": i} for i in range(5)])
    # The wakeups on the broker are Celery task messages named by their job ids.
    messages = _queued(amqp_broker.url, "celery")
    assert sorted(m.headers["id"] for m in messages) == sorted([one.id] + [j.id for j in many])
    assert {m.headers["task"] for m in messages} == {one.task}
    # Taken off the queue: only the sweeper can wake them now, through the same transport.
    swept = []
    wait_for(lambda: swept.append(mod.leases.sweep()) or sum(swept) >= 6, timeout=30, interval=0.5, what="the sweeper")
    assert sum(swept) == 6
    workers(pg, amqp_broker.url, conf=conf)
    for job in [one, *many]:
        done = mod.leases.wait(job.id, timeout=60)
        assert done.status is Status.SUCCEEDED and done.attempt == 1


def test_cancel_notice_reaches_the_worker_over_a_fanout_exchange(pg, amqp_broker, client_app, workers, marker_dir):
    # A 300 s lease: the next renewal is 100 s away, so only the notice stops it this soon.
    mod = client_app(pg, amqp_broker.url, extra_env=LONG, module="tests.apps.app_faults")
    w = workers(pg, amqp_broker.url, extra_env=LONG, module="tests.apps.app_faults")
    job = mod.waiter.submit({"polls": 600, "marker_dir": str(marker_dir)})  # 60 s of polling
    pid_in(marker_dir / f"waiter-{job.id}")
    exchange = cancel_notice.channel(mod.app.conf.broker_url, mod.app.main)
    node = amqp_broker.node

    def bound() -> bool:
        return exchange in node.ctl("list_bindings", "-p", amqp_broker.vhost, "source_name", "--no-table-headers")

    wait_for(bound, timeout=30, interval=0.5, what="the notice listener's queue")
    assert mod.leases.cancel(job.id) is True
    assert mod.leases.get(job.id).status is Status.CANCELLED
    wait_for(
        lambda: f"job {job.id}: stopped after cancel or lease loss" in w.log(),
        timeout=20,
        what="the handler to stop at raise_if_cancelled",
    )


def test_beat_reaps_and_sweeps_on_rabbitmq(pg, amqp_broker, client_app, workers, beats, db, make_job):
    beat_reaps_and_sweeps(pg, amqp_broker.url, client_app, workers, beats, db, make_job)


def test_an_exchange_declared_otherwise_is_a_warning_once(amqp_broker, caplog):
    """Before: an exchange of the notices' name pre-declared with other attributes
    (durable here) refused every declaration of ours, and only a debug line said that
    fast cancel was off for good."""
    import logging
    import time

    from kombu import Exchange

    from celery_lease.broker import notice_amqp

    name = "celery-lease-notices-preset"
    with Connection(amqp_broker.url) as conn:
        Exchange(name, type="fanout", durable=True)(conn.default_channel).declare()
    notice_amqp._warned.clear()
    caplog.set_level(logging.INFO, logger="celery_lease.cancel_notice")
    assert notice_amqp.publish(amqp_broker.url, name, ['{"job": 1}'], timeout=5) is False
    assert notice_amqp.publish(amqp_broker.url, name, ['{"job": 2}'], timeout=5) is False
    # (A daemon thread: it retries every 0.3 s until the test process ends.)
    notice_amqp.listen(amqp_broker.url, name, lambda body: None, reconnect_seconds=0.3)
    time.sleep(1.5)  # the listener has tried (and been refused) several times
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert name in warnings[0].getMessage() and "cancel notices are off" in warnings[0].getMessage()
