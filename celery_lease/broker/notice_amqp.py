"""Cancel notices over an AMQP broker (RabbitMQ), where there is no Redis pub/sub.

Same contract as :mod:`celery_lease.broker.cancel_notice` (best effort, a shortcut before the
next heartbeat, untrusted input parsed and rate-limited by its ``Listener``): ``cancel``
publishes to a non-durable fanout exchange named after the app's notice channel, so a
notice nobody listens to is dropped at once; every worker process that holds a lease binds
a private queue to it (exclusive, auto-deleted, no acks, no persistence) and wakes its
heartbeat. The broker, not PostgreSQL LISTEN/NOTIFY, because job database connections are
the scarce resource of a fleet of prefork workers (docs/decisions.md).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from amqp.exceptions import AMQPError, PreconditionFailed
from kombu import Connection, Consumer, Exchange, Producer, Queue
from kombu.exceptions import KombuError

log = logging.getLogger("celery_lease.cancel_notice")

SCHEMES = ("amqp", "amqps", "pyamqp")
#: AMQP heartbeats of a listener's connection: a broker that vanished without closing
#: the socket (host down, network cut) is noticed within two of these.
HEARTBEAT_SECONDS = 10


def amqp_url(broker_url: Any) -> str | None:
    """The broker URL when it is an AMQP server, else None."""
    if isinstance(broker_url, str) and broker_url.split("://", 1)[0] in SCHEMES:
        return broker_url
    return None


def _exchange(name: str) -> Exchange:
    return Exchange(name, type="fanout", durable=False, delivery_mode="transient")


_warned = threading.Event()


def _warn_if_declared_otherwise(exc: BaseException, name: str) -> None:
    """An exchange of that name already declared with other attributes (durable, another
    type) refuses every declaration of ours (406 PRECONDITION_FAILED): fast cancel is
    off for good, not for a broker's brief outage. That is an operator's to fix, so it is a
    WARNING, once per process (a listener retries every few seconds)."""
    if isinstance(exc, PreconditionFailed) and not _warned.is_set():
        _warned.set()
        log.warning(
            "celery-lease: the AMQP exchange %r exists with other attributes than a transient, non-durable fanout (%s): "
            "cancel notices are off, running jobs learn of a cancel at their next heartbeat; delete the exchange",
            name,
            exc,
        )


def publish(url: str, name: str, notices: Iterable[str], timeout: float) -> bool:
    """Send each notice (a JSON text) to the exchange ``name``; False when none could be."""
    exchange = _exchange(name)
    try:
        with Connection(url, connect_timeout=timeout) as conn:
            conn.ensure_connection(max_retries=0)  # one try: leases.cancel must not wait for a retry loop
            with conn.channel() as channel:
                producer = Producer(channel)
                for notice in notices:
                    producer.publish(
                        notice.encode("utf-8"),
                        exchange=exchange,
                        routing_key="",
                        declare=[exchange],
                        content_type="application/json",
                        content_encoding="binary",
                        retry=False,
                    )
        return True
    except (OSError, AMQPError, KombuError) as exc:
        _warn_if_declared_otherwise(exc, name)
        log.info("celery-lease: cancel notice not sent (%s); heartbeats will notice", type(exc).__name__)
        return False


def listen(url: str, name: str, handle: Callable[[bytes], Any], reconnect_seconds: float) -> None:
    """Start this process's listener thread on the exchange ``name``; ``handle`` gets
    each notice's body (cancel_notice.Listener.handle: it parses and rate-limits)."""
    thread = threading.Thread(
        target=_listen, args=(url, name, handle, reconnect_seconds), name="celery-lease-cancel-notice", daemon=True
    )
    thread.start()


def _listen(url: str, name: str, handle: Callable[[bytes], Any], reconnect_seconds: float) -> None:
    exchange = _exchange(name)
    # One queue per process, gone with its connection: a restarted broker forgets it, and
    # the next connection declares it again.
    queue_name = f"{name}.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}"

    def on_message(message: Any) -> None:
        handle(message.body)

    while True:
        try:
            with Connection(url, heartbeat=HEARTBEAT_SECONDS) as conn:
                conn.connect()
                queue = Queue(queue_name, exchange, routing_key="", exclusive=True, auto_delete=True, durable=False)
                with Consumer(conn.default_channel, [queue], on_message=on_message, no_ack=True):
                    while True:
                        try:
                            conn.drain_events(timeout=HEARTBEAT_SECONDS / 2)
                        except TimeoutError:
                            conn.heartbeat_check()
        except Exception as exc:  # the broker restarting or unreachable: the heartbeat covers the gap
            _warn_if_declared_otherwise(exc, name)
            log.debug("celery-lease: cancel-notice listener reconnecting", exc_info=True)
        time.sleep(reconnect_seconds)
