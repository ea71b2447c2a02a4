"""Celery's moments mapped onto lease transitions. Handlers stay thin.

- ``worker_init``: green driver (green.py), Redis-restart guard (broker_restart.py), pool
  sizes for the concurrency, the database checked (exit with one clear line if not).
- ``worker_ready``: restart recovery before new work; a prefork pool drains its children's
  results at a warm stop (prefork.py).
- ``task_prerun``: claim the job and start its heartbeats (a plain task: scrub the leased
  signatures it carries); the task body runs the handler and records the outcome.
- ``task_postrun``: stop the heartbeats. ``worker_shutting_down``: warm shutdown, handlers
  hand their job off. ``worker_process_shutdown`` / ``worker_shutdown``: write the
  successes the completer holds. The revoke control command cancels jobs, off the consumer (revoke.py).
The rule: Celery signals are process-global, so every handler first checks its sender.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from celery import Celery, signals

from celery_lease import tracing
from celery_lease.db import green
from celery_lease.errors import LeaseError
from celery_lease.worker import broker_restart, events, message_signatures, prefork, revoke, shutdown
from celery_lease.worker.task import LeaseTask

if TYPE_CHECKING:
    from celery_lease.worker.executor import WorkerState

log = logging.getLogger("celery_lease")


def connect(
    app: Celery,
    owner: object,
    *,
    ping: Callable[[], None],
    size_pools: Callable[[int], None],
    recover: Callable[[str], dict[str, int]],
    worker_state: Callable[[], WorkerState],
    cancel_ids: Callable[[list[str]], list[str]],
) -> None:
    """Connect the handlers for ``app``'s leased tasks (those whose ``owner`` is ``owner``)."""

    def ours(task) -> bool:
        return isinstance(task, LeaseTask) and task.owner is owner

    @signals.worker_init.connect(weak=False)
    def prepare_worker(sender=None, **_):
        if getattr(sender, "app", None) is not app:
            return
        # A green pool (-P gevent / eventlet): the database driver yields to the hub.
        if green.cooperate() is not None:
            _no_prefetch_reduction(app)
        # Every pool: on Celery 5.7 a Redis restart could end the worker (its jobs then
        # wait for the reaper). Process-wide and idempotent.
        broker_restart.install()
        # Pools follow the worker's concurrency (threads pool: all in this process).
        concurrency = getattr(sender, "concurrency", None)
        size_pools(concurrency if isinstance(concurrency, int) else (os.cpu_count() or 2))
        try:
            ping()
        except LeaseError as exc:
            # Signal.send swallows exceptions; a worker that cannot reach its job
            # table must not start, so exit with one readable line.
            print(f"celery-lease: {exc}", file=sys.stderr)
            raise SystemExit(1)

    @signals.worker_ready.connect(weak=False)
    def recover_interrupted(sender=None, **_):
        if getattr(sender, "app", None) is not app:
            return
        counts = recover(sender.hostname)
        if any(counts.values()):
            log.warning("celery-lease: restart recovery on %s: %s", sender.hostname, counts)

    @signals.worker_ready.connect(weak=False)
    def drain_pool_at_stop(sender=None, **_):
        if getattr(sender, "app", None) is app:
            # Else a warm stop could wait 30 s for a pool child (issue #27 item 7).
            prefork.drain_at_stop(getattr(sender, "pool", None))

    def leased(name: object) -> bool:
        return isinstance(name, str) and ours(app.tasks.get(name))

    @signals.task_prerun.connect(weak=False)
    def claim(sender=None, task=None, **_):
        if task is not None and not ours(task) and getattr(task, "app", None) is app:
            # A plain task: the leased jobs its message's chain or callbacks create
            # take no tenant or run from that message (worker/message_signatures.py).
            message_signatures.scrub(task.request, leased)
            return
        if ours(task):
            request = task.request
            request.lease_attempt = None  # stays None if the claim raises
            refusal = message_signatures.wakeup_refusal(request)
            if refusal is not None:
                log.warning("celery-lease: delivery %.64r of %s refused before the claim: %s", request.id, task.name, refusal)
                return
            queue = (request.delivery_info or {}).get("routing_key")
            started = tracing.clock()  # the attempt's span starts with its claim
            # Recorded at once: the claim is committed, and nothing after it may keep the
            # body from running (Celery swallows what a task_prerun receiver raises).
            request.lease_attempt = attempt = worker_state().begin(request.id, task.spec, request.hostname, queue)
            if started is not None and attempt is not None:
                tracing.start_attempt(attempt, queue, started, request)

    @signals.task_postrun.connect(weak=False)
    def release(sender=None, task=None, retval=None, **_):
        if ours(task):
            attempt = getattr(task.request, "lease_attempt", None)
            if attempt is not None:
                tracing.end_attempt(attempt)
            worker_state().end(attempt)
            if isinstance(retval, BaseException):
                # Ignore (a skipped delivery), Retry, JobFailed: the exception's traceback
                # starts in Celery's trace frame, whose locals hold the exception again; that
                # cycle would wait for a full garbage collection (docs/decisions.md).
                # Everything Celery reports was built from it already.
                retval.__traceback__ = None

    @signals.worker_shutting_down.connect(weak=False)
    def suspend(sender=None, how=None, **_):
        # Only a warm shutdown lets handlers run to their next stop point.
        if how == "Warm":
            shutdown.request()

    @signals.worker_process_shutdown.connect(weak=False)  # a prefork child exits
    @signals.worker_shutdown.connect(weak=False)  # the main process (solo, threads pools)
    def flush(sender=None, **_):
        # The completer's successes land before the process exits.
        worker_state().flush()

    app._celery_lease_signal_handlers = (prepare_worker, recover_interrupted, drain_pool_at_stop, claim, release, suspend, flush)
    # `celery control revoke` cancels the job (never a discarded or expired message).
    revoke.connect(app, ours=ours, cancel_ids=cancel_ids)
    events.connect(app)


#: Celery's setting that, after a broker reconnect, lowers the prefetch count and restores
#: it from each task's acknowledgement.
_REDUCTION = "worker_enable_prefetch_count_reduction"


def _no_prefetch_reduction(app: Celery) -> None:
    """Celery restores a reduced prefetch count from the task's acknowledgement, which on a
    green pool runs in the task's greenlet: its ``basic.qos`` waits for the reply on the
    AMQP socket the consumer's greenlet is already reading, gevent raises
    ConcurrentObjectUseError, and after a RabbitMQ restart the worker never consumes again
    (issue #27 item 6). Without the reduction the reconnected consumer starts at the full
    prefetch count, which costs a leased job nothing: its claim, not its delivery, decides
    who runs it. An application that set the option itself is told, not overruled."""
    if _REDUCTION in app.conf.changes:
        if app.conf[_REDUCTION]:
            log.warning(
                "celery-lease: %s=True on a green pool: after a broker reconnect a task's "
                "acknowledgement may read the consumer's socket and the worker stop consuming",
                _REDUCTION,
            )
        return
    app.conf[_REDUCTION] = False
