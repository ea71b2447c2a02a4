"""Faster cancel notice: a Redis pub/sub message that wakes the heartbeats.

The table is the truth and the heartbeat is the guarantee: a cancelled job's lease is
revoked by the cancel statement itself, and the worker holding it learns at its next
renewal (within ``lease_seconds / 3``). This module only shortens that wait. When the
broker is Redis, ``cancel`` publishes the cancelled ids on one channel, and every
worker process that holds a lease listens there and renews at once on any message;
the renewal finds the revoked lease and marks the attempt lost.

Best-effort in both directions: a notice that cannot be published, or that arrives
while a listener is reconnecting, is simply lost and the heartbeat takes over.
Pub/sub is not scoped to a Redis database number, so a notice may wake processes of
another app sharing the server; that costs them one renewal statement, nothing more.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("celery_lease.cancel_notice")

CHANNEL = "celery-lease:cancelled"
#: Publishing is on the caller's path (leases.cancel): never wait long for Redis.
PUBLISH_TIMEOUT = 1.0
#: A listener that lost its connection tries again after this long.
RECONNECT_SECONDS = 1.0


def redis_url(broker_url: Any) -> str | None:
    """The broker URL when it is a Redis server, else None (no notices)."""
    url = broker_url
    if isinstance(url, str) and url.split("://", 1)[0] in ("redis", "rediss"):
        return url
    return None


def publish(broker_url: Any, job_ids: list[str]) -> bool:
    """Announce cancelled jobs; False when no notice could be sent."""
    url = redis_url(broker_url)
    if url is None or not job_ids:
        return False
    import redis

    client = redis.Redis.from_url(url, socket_timeout=PUBLISH_TIMEOUT, socket_connect_timeout=PUBLISH_TIMEOUT)
    try:
        client.publish(CHANNEL, json.dumps(job_ids))
        return True
    except redis.RedisError as exc:
        log.info("celery-lease: cancel notice not sent (%s); heartbeats will notice", type(exc).__name__)
        return False
    finally:
        client.close()


def listen(broker_url: Any, wake: Callable[[], None]) -> threading.Thread | None:
    """Start this process's listener thread, calling ``wake()`` on every notice.

    Called once per process (by the heartbeat when it starts); returns None when the
    broker is not Redis.
    """
    url = redis_url(broker_url)
    if url is None:
        return None
    thread = threading.Thread(target=_listen, args=(url, wake), name="celery-lease-cancel-notice", daemon=True)
    thread.start()
    return thread


def _listen(url: str, wake: Callable[[], None]) -> None:
    import redis

    while True:
        client = redis.Redis.from_url(url, socket_connect_timeout=PUBLISH_TIMEOUT)
        try:
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            pubsub.subscribe(CHANNEL)
            for message in pubsub.listen():
                if message.get("type") == "message":
                    wake()
        except redis.RedisError:
            pass  # Redis restarting: the heartbeat covers the gap
        finally:
            client.close()
        time.sleep(RECONNECT_SECONDS)
