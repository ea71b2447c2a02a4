"""Celery's prefork pool at a warm stop: read each child's results until it has exited.

At a warm stop Celery's pool forgets every delivery whose acceptance it has not read
yet, including one already written to a child, and its result handler then reads the
children's results only while it still tracks a delivery. The child runs the forgotten
delivery anyway, and billiard makes it wait (up to 30 s) for the main process to read
its last result before it exits, so the stop took 30 s longer. :func:`drain_at_stop`
makes the result handler go on reading, once it tracks no delivery, until every child
has exited: the forgotten delivery's results are read and dropped, and the child exits
at once. The rule: nothing else changes; no delivery is tracked again, and the broker
still redelivers the forgotten message (for a leased job a duplicate wakeup, skipped).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("celery_lease.worker")

#: The result handler's members the drain uses (Celery 5.5 to 5.7); a pool without
#: them (threads, solo, gevent, eventlet, another Celery) is left as it is.
_NEEDS = ("on_stop_not_started", "_flush_outqueue", "fileno_to_outq", "on_state_change", "join_exited_workers", "_state")


def drain_at_stop(pool: Any) -> bool:
    """Make a prefork worker's pool (``consumer.pool``) read its children's results at a
    stop until they have exited; True if it does now."""
    handler = getattr(getattr(pool, "_pool", None), "_result_handler", None)
    if handler is None or not all(hasattr(handler, name) for name in _NEEDS):
        return False
    if getattr(handler, "_celery_lease_drains", False):
        return True
    stop = handler.on_stop_not_started

    def on_stop_not_started() -> None:
        stop()  # reads while the pool tracks a delivery
        try:
            _read_until_exited(handler)
        except Exception:  # Celery's internals changed: its own join, as before
            log.warning("celery-lease: the pool's results not read to the end at the stop", exc_info=True)

    handler.on_stop_not_started = on_stop_not_started
    handler._celery_lease_drains = True
    return True


def _read_until_exited(handler: Any) -> None:
    """The result handler's own loop (``on_stop_not_started``) with one condition less:
    it goes on while any child's results may come, not only while a delivery is tracked.
    ``_flush_outqueue`` reads one message of a child, or sleeps 0.5 s when none is there;
    ``join_exited_workers`` reaps the children that exited, and says when all have."""
    from billiard.pool import TERMINATE, WorkersJoined
    from celery.concurrency.asynpool import iterate_file_descriptors_safely

    outqueues = set(handler.fileno_to_outq)
    while outqueues and handler._state != TERMINATE:
        gone: set[int] = set()
        for fd in outqueues:
            iterate_file_descriptors_safely(
                [fd], handler.fileno_to_outq, handler._flush_outqueue, gone.add, handler.fileno_to_outq, handler.on_state_change
            )
            try:
                handler.join_exited_workers(shutdown=True)
            except WorkersJoined:
                return
        outqueues -= gone
