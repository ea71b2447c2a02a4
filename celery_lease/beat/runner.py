"""Beat's maintenance ticks, run by a thread of each worker's main process.

The rule: a tick never goes through the worker pool, whatever the pool is doing (a
reaper that does not run undoes every other guarantee). Each worker's main process runs
one :class:`TickRunner` thread with its own broker connection, consuming only the
maintenance queue, one message at a time; the pool's consumer does not take that queue
(``entries.register``). Ticks carry no ``expires``: a backlog is drained instead (a tick
of a kind this worker ran less than half an interval ago is acked and skipped). The
runner announces each tick's end to event monitors itself (:meth:`TickRunner._announce`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from celery import Celery
from kombu import Consumer

log = logging.getLogger("celery_lease.maintenance")


class TickRunner:
    #: Seconds between checks of the stop flag while the queue is empty.
    POLL = 1.0
    #: Seconds to wait before reconnecting after a broker error.
    RECONNECT = 1.0

    def __init__(
        self, app: Celery, queue: str, tasks: dict[str, tuple[Callable[[], Any], float]], hostname: str | None = None
    ) -> None:
        self._app = app
        self._queue = queue
        #: The worker's node name, which the tick's events carry (Flower's "worker").
        self._hostname = hostname
        #: task name -> (what to run, its interval in seconds)
        self._tasks = tasks
        self._last: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="celery-lease-ticks", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._consume()
            except Exception as exc:
                # The broker restarted or is unreachable: reconnect; ticks wait in Redis.
                log.warning("celery-lease: maintenance tick consumer: %s; reconnecting", type(exc).__name__)
                self._stop.wait(self.RECONNECT)

    def _consume(self) -> None:
        queue = self._app.amqp.queues[self._queue]  # declared as beat's producer declares it
        with self._app.connection_for_read() as conn:
            conn.ensure_connection(max_retries=1)
            consumer = Consumer(
                conn,
                queues=[queue],
                callbacks=[self._on_message],
                accept=self._app.conf.accept_content,
                on_decode_error=self._on_undecodable,
                prefetch_count=1,
            )
            with consumer:
                while not self._stop.is_set():
                    try:
                        conn.drain_events(timeout=self.POLL)
                    except TimeoutError:
                        conn.heartbeat_check()

    def _on_undecodable(self, message: Any, exc: Exception) -> None:
        # A message of a content type the app does not accept (unsigned where
        # task_serializer="auth", pickle...) or that does not decode: dropped. Raised,
        # it would end the consumer, and the unacked message would come back first on
        # every reconnect: no tick would ever run again.
        log.warning("celery-lease: dropped an undecodable message from the maintenance queue: %s", type(exc).__name__)
        message.ack()

    def _on_message(self, body: Any, message: Any) -> None:
        headers = message.headers or {}
        name = headers.get("task") or (body.get("task") if isinstance(body, dict) else None)
        task_id = headers.get("id")
        # Acked before running: a tick is idempotent, and one lost with this process is
        # replaced by the next one beat sends.
        message.ack()
        entry = self._tasks.get(name or "")
        if entry is None:
            log.warning("celery-lease: dropped a message for %r from the maintenance queue", name)
            return
        run, interval = entry
        now = time.monotonic()
        last = self._last.get(name or "")
        # A backlog (workers were down while beat ran) is drained, not run tick by tick:
        # ticks are idempotent and bounded, so skipping or running one late is harmless.
        if last is not None and now - last < interval / 2:
            self._announce(task_id, "task-succeeded", result="skipped", runtime=0.0)
            return
        self._last[name or ""] = now
        try:
            done = run()
            log.debug("celery-lease: maintenance tick %s done", name)
            self._announce(task_id, "task-succeeded", result=repr(done), runtime=time.monotonic() - now)
        except Exception as exc:
            log.exception("celery-lease: maintenance tick %s failed", name)
            self._announce(task_id, "task-failed", exception=type(exc).__name__, traceback=None)

    def _announce(self, task_id: Any, event: str, **fields: Any) -> None:
        """Tell event monitors (Flower) how a tick beat announced has ended: with
        ``task_send_sent_event`` beat announces every tick it sends, and only the pool's
        consumer, which a tick never reaches, would announce its end. One event, never
        retried: a monitor that misses it only shows that tick as PENDING."""
        if not (self._app.conf.task_send_sent_event and isinstance(task_id, str)):
            return
        try:
            with self._app.events.default_dispatcher(hostname=self._hostname) as dispatcher:
                dispatcher.send(event, uuid=task_id, **fields)
        except Exception as exc:
            log.debug("celery-lease: cannot announce maintenance tick %s: %s", task_id, type(exc).__name__)
