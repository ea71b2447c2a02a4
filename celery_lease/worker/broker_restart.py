"""A Celery 5.7 worker survives its Redis broker's restart.

On a lost broker connection, Celery 5.7.0's consumer (``on_connection_error_after_connected``)
collects the connection, which closes its channels and then detaches the transport from
it (``transport.client = None``), and closes the connection once more. The first close can
leave the task channel half closed: reading its pending BRPOP reply raises before the
channel is marked closed, and the pub/sub channel's queue delete (remote control, task
events) aborts the loop that would have closed it again. The second close then restores
the channel's unacked messages, which builds a new Redis pool from parameters read off
the detached transport: ``AttributeError: 'NoneType' object has no attribute
'hostname'``. Nothing catches an AttributeError there: the worker exits with
"Unrecoverable error", its jobs wait for the reaper and nothing runs until someone
restarts it. Measured on a private Redis SIGKILLed and restarted 30 times: a ``-P gevent -E``
worker exited at 26 of them; prefork and threads rarely (one chaos run lost both
workers at once). Celery 5.6 never closes twice.

:func:`install` turns that one case into what it is, a connection error (the transport
is gone): kombu and Celery ignore connection errors while closing, the unacked messages
stay in Redis until the visibility timeout restores them (as when Redis is down at that
close), and the consumer reconnects. While the transport is attached nothing changes.
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
