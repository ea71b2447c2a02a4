"""A Celery 5.7 worker survives its Redis broker's restart (docs/guide.md).

On a lost broker connection Celery 5.7's consumer closes the connection twice; the second
close restores the channel's unacked messages through a transport already detached from
it (``transport.client = None``), raising ``AttributeError: 'NoneType' object has no
attribute 'hostname'``, which nothing catches: the worker exits with "Unrecoverable
error". :func:`install` turns that one case into what it is, a connection error (the
transport is gone): kombu and Celery ignore connection errors while closing, the unacked
messages stay in Redis until the visibility timeout restores them, and the consumer
reconnects. The rule: while the transport is attached nothing changes.
"""

from __future__ import annotations

from typing import Any

import celery


def install() -> None:
    """Guard kombu's Redis channel on Celery 5.7 and later (idempotent; nothing to do
    without the redis client or on an older Celery)."""
    if celery.VERSION[:2] < (5, 7):
        return
    try:
        import redis
        from kombu.transport import redis as transport
    except ImportError:  # no Redis broker in this process
        return
    connparams = transport.Channel._connparams
    if getattr(connparams, "guarded", False):
        return

    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self.connection, "client", None) is None:
            raise redis.exceptions.ConnectionError("the Redis broker connection was closed")
        return connparams(self, *args, **kwargs)

    guarded.guarded = True  # type: ignore[attr-defined]
    setattr(transport.Channel, "_connparams", guarded)  # noqa: B010 (mypy: a method is not assignable)
