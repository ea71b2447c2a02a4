"""Faster cancel notice: a Redis pub/sub message (on an AMQP broker a fanout exchange:
:mod:`celery_lease.broker.notice_amqp`) that wakes the heartbeats of the workers holding a job.

The table is the truth and the heartbeat the guarantee: the cancel statement revokes the
lease and the holder learns at its next renewal; a notice only makes that renewal happen
at once. Best effort both ways: a notice not published, dropped or missed while a
listener reconnects is lost, and the heartbeat takes over. The rule: a notice is
untrusted input (anything that reaches Redis can publish one), so a listener hears only
its own app's :func:`channel`, parses each notice (a JSON list of at most :data:`MAX_IDS`
job ids, at most :data:`MAX_NOTICE_BYTES`; anything else is ignored whole), acts only on
jobs this process holds, and renews at most :data:`WAKE_RATE` times a second (bursts of
:data:`WAKE_BURST`), dropping the rest.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from celery_lease.broker import notice_amqp
from celery_lease.job import parse_job_id

log = logging.getLogger("celery_lease.cancel_notice")

CHANNEL_PREFIX = "celery-lease:cancelled"
#: Publishing is on the caller's path (leases.cancel): never wait long for Redis.
PUBLISH_TIMEOUT = 1.0
#: A listener that lost its connection tries again after this long.
RECONNECT_SECONDS = 1.0
#: A notice longer than this is ignored unread.
MAX_NOTICE_BYTES = 64 * 1024
#: Ids per notice; a cancel of more jobs publishes several notices.
MAX_IDS = 1000
#: Renewals a second that notices may cause, and the burst allowed above that rate.
WAKE_RATE = 10.0
WAKE_BURST = 20
#: Ignored and dropped notices are reported in the log at most this often.
REPORT_SECONDS = 60.0


def redis_url(broker_url: Any) -> str | None:
    """The broker URL when it is a Redis server, else None (no notices)."""
    url = broker_url
    if isinstance(url, str) and url.split("://", 1)[0] in ("redis", "rediss"):
        return url
    return None


def channel(broker_url: Any, app_name: str | None) -> str:
    """The channel of one app's notices on one Redis database (the database number is in
    the name: pub/sub itself ignores database numbers)."""
    db = 0
    url = redis_url(broker_url)
    if url is not None:
        from redis.connection import parse_url

        try:
            db = int(parse_url(url).get("db") or 0)
        except (ValueError, TypeError):
            db = 0
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", app_name or "celery")[:100]
    return f"{CHANNEL_PREFIX}:{db}:{name}"


def publish(broker_url: Any, job_ids: list[str], channel_name: str | None = None) -> bool:
    """Announce cancelled jobs; False when no notice could be sent."""
    if not job_ids:
        return False
    notices = [json.dumps(job_ids[start : start + MAX_IDS]) for start in range(0, len(job_ids), MAX_IDS)]
    url = redis_url(broker_url)
    if url is None:
        amqp = notice_amqp.amqp_url(broker_url)
        if amqp is None:
            return False
        return notice_amqp.publish(amqp, channel_name or channel(amqp, None), notices, PUBLISH_TIMEOUT)
    import redis

    name = channel_name or channel(url, None)
    client = redis.Redis.from_url(url, socket_timeout=PUBLISH_TIMEOUT, socket_connect_timeout=PUBLISH_TIMEOUT)
    try:
        for notice in notices:
            client.publish(name, notice)
        return True
    except redis.RedisError as exc:
        log.info("celery-lease: cancel notice not sent (%s); heartbeats will notice", type(exc).__name__)
        return False
    finally:
        client.close()


def parse(data: Any) -> set[str] | None:
    """The job ids a notice names, or None when it is not a well-formed notice."""
    if isinstance(data, str):
        data = data.encode("utf-8", "replace")
    if not isinstance(data, bytes) or len(data) > MAX_NOTICE_BYTES:
        return None
    try:
        ids = json.loads(data)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested past the parser's depth
        return None
    if not isinstance(ids, list) or not 0 < len(ids) <= MAX_IDS:
        return None
    if not all(isinstance(i, str) and len(i) == 36 for i in ids):
        return None
    try:
        return {parse_job_id(i) for i in ids}
    except ValueError:
        return None


class Listener:
    """Turns notices into heartbeat wake-ups: only well-formed ones, naming a job this
    process holds, at a bounded rate. Counts what it saw (for logs and tests)."""

    def __init__(self, wake: Callable[[], None], held: Callable[[], Iterable[str]]) -> None:
        self._wake = wake
        self._held = held
        self._thread: threading.Thread | None = None
        self._target: tuple[str, str] | None = None  # (Redis URL, channel) once started
        self.received = 0
        self.ignored = 0  # malformed, or naming no job held here
        self.dropped = 0  # over the rate
        self.woken = 0
        self._tokens = float(WAKE_BURST)
        self._refilled = time.monotonic()
        self._reported = (0, 0)
        self._reported_at = 0.0

    def start(self, url: str, name: str) -> None:
        self._target = (url, name)
        self.ensure_running()

    def ensure_running(self) -> bool:
        """Start the listening thread again if it ever ended; True when it was restarted.
        (Its loop outlives any notice and any error; this covers what cannot be caught.)"""
        if self._target is None or (self._thread is not None and self._thread.is_alive()):
            return False
        restarted = self._thread is not None
        if restarted:
            log.warning("celery-lease: the cancel-notice listener had stopped; restarted")
        url, name = self._target
        self._thread = threading.Thread(target=_listen, args=(url, name, self), name="celery-lease-cancel-notice", daemon=True)
        self._thread.start()
        return restarted

    def handle(self, data: Any) -> bool:
        """One notice; True when it woke the heartbeat. Never raises: a notice is
        untrusted input, and the listener must outlive any of them."""
        try:
            return self._handle(data)
        except Exception:
            log.exception("celery-lease: a cancel notice could not be handled; ignored")
            self.ignored += 1
            return False

    def _handle(self, data: Any) -> bool:
        self.received += 1
        ids = parse(data)
        if not ids or ids.isdisjoint(self._held()):
            self.ignored += 1
            self._report()
            return False
        now = time.monotonic()
        self._tokens = min(float(WAKE_BURST), self._tokens + (now - self._refilled) * WAKE_RATE)
        self._refilled = now
        if self._tokens < 1.0:
            self.dropped += 1
            self._report()
            return False
        self._tokens -= 1.0
        self.woken += 1
        self._wake()
        return True

    def _report(self) -> None:
        now = time.monotonic()
        if now - self._reported_at >= REPORT_SECONDS and (self.ignored, self.dropped) != self._reported:
            self._reported_at = now
            self._reported = (self.ignored, self.dropped)
            log.info(
                "celery-lease: cancel notices ignored (malformed or naming no job held here): %d; dropped over the rate: %d",
                self.ignored,
                self.dropped,
            )


def listen(
    broker_url: Any, wake: Callable[[], None], *, held: Callable[[], Iterable[str]], channel_name: str | None = None
) -> Listener | None:
    """Start this process's listener thread, calling ``wake()`` for each notice that
    names a job in ``held()`` (within the rate).

    Called once per process (by the heartbeat when it starts); returns None when the
    broker is neither Redis nor AMQP.
    """
    url = redis_url(broker_url)
    if url is None:
        amqp = notice_amqp.amqp_url(broker_url)
        if amqp is None:
            return None
        listener = Listener(wake, held)
        notice_amqp.listen(amqp, channel_name or channel(amqp, None), listener.handle, RECONNECT_SECONDS)
        return listener
    listener = Listener(wake, held)
    listener.start(url, channel_name or channel(url, None))
    return listener


def _listen(url: str, name: str, listener: Listener) -> None:
    import redis

    while True:
        client = redis.Redis.from_url(url, socket_connect_timeout=PUBLISH_TIMEOUT)
        try:
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            pubsub.subscribe(name)
            for message in pubsub.listen():
                if message.get("type") == "message":
                    listener.handle(message.get("data"))
        except redis.RedisError:
            pass  # Redis restarting: the heartbeat covers the gap
        except Exception:
            # Whatever it was, listening goes on: a listener that died would leave
            # every later cancel to the heartbeat, in every worker.
            log.exception("celery-lease: the cancel-notice listener failed; reconnecting")
        finally:
            client.close()
        time.sleep(RECONNECT_SECONDS)
