"""The queue a job belongs to: the one Celery routes its task to, resolved once at submit
(docs/guide.md, "queue").

Celery's own ``Router.route`` is called, so the precedence is Celery's exactly: ``queue=``
given to the call or signature, the task's own ``queue``, ``app.conf.task_routes``, then
``task_default_queue``. A router function receives ``args=(payload,)`` (the stored JSON
form) and ``kwargs={}``. The rule: the name found is stored in the job's ``queue`` column
and every wakeup of the job is sent there, never routed again (a wakeup carries no
payload, so a router asked per wakeup could send the job elsewhere than its first). Routes
that are only dicts are kept per (task, queue=) for the process; a function or class is
asked once per job. A route naming an exchange but no queue stores NULL (Celery routes
each wakeup, as before).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from celery import Celery
from celery.app.routes import MapRoute

#: (task, queue=) answers kept for dict-only routes; more start the cache afresh.
MAX_CACHED = 256


class QueueRouter:
    """Resolves the queue of a new job of one Celery app (see the module docstring)."""

    def __init__(self, app: Celery) -> None:
        self._app = app
        self._cache: dict[tuple[str, str | None], str | None] = {}
        self._router: Any = None  # the app's Router the cache was filled from

    def queue(self, task: str, queue: str | None, payload: Any) -> str | None:
        """The queue a job of Celery task ``task`` goes to; ``queue``: the ``queue=``
        given at submit, else the kind's own (or None): Celery's precedence, and the
        task may still be a lazy proxy the app has not registered. Raises Celery's
        QueueNotFound for a queue the app does not know when ``task_create_missing_queues``
        is off, as ``send_task`` would."""
        return self.queues(task, queue, [payload])[0]

    def queues(self, task: str, queue: str | None, payloads: Sequence[Any]) -> list[str | None]:
        """:meth:`queue` of each payload of one submit_many; dict-only routes are worked
        out once for all of them."""
        router = self._app.amqp.router
        if router is not self._router:  # routes reconfigured (a test's app, a reload)
            self._cache.clear()
            self._router = router
        if not all(isinstance(r, MapRoute) for r in router.routes):
            return [self._resolve(router, task, queue, payload) for payload in payloads]
        key = (task, queue)
        if key not in self._cache:
            if len(self._cache) >= MAX_CACHED:
                self._cache.clear()
            self._cache[key] = self._resolve(router, task, queue, None)
        return [self._cache[key]] * len(payloads)

    def _resolve(self, router: Any, task: str, queue: str | None, payload: Any) -> str | None:
        # What Task.apply_async hands send_task, and send_task hands the router: the
        # task's execution options (its queue among them) under the call's own.
        task_type = self._app._tasks.get(task)  # as send_task: without finalizing the app
        get_exec_options = getattr(task_type, "_get_exec_options", None)
        options: dict[str, Any] = dict(get_exec_options()) if get_exec_options is not None else {}
        if queue is not None:
            options["queue"] = queue
        routed = router.route(options, task, (payload,), {}, task_type)
        target = routed.get("queue")
        if target is None:
            # send_task_message's fallback: no queue and no exchange -> the default queue.
            return None if routed.get("exchange") else self._app.amqp.default_queue.name
        return str(getattr(target, "name", target))


def consumed_queues(app: Celery, queues: list[str | None]) -> list[str]:
    """Every queue a worker must consume to run an app's jobs: the default queue,
    ``task_queues``, the queues ``task_routes``' dicts name and ``queues`` (the leased
    kinds' own, as resolved for them). What a router function decides per payload is
    not knowable in advance; its queues must be declared in ``task_queues``."""
    names = [app.amqp.default_queue.name]
    declared = app.conf.task_queues or ()
    names += list(declared) if isinstance(declared, Mapping) else [q.name for q in declared]
    for route in app.amqp.router.routes:
        if isinstance(route, MapRoute):
            for value in [*route.map.values(), *route.patterns.values()]:
                target = value if isinstance(value, str) else dict(value).get("queue")
                if target is not None:
                    names.append(str(getattr(target, "name", target)))
    names += [q for q in queues if q]
    return list(dict.fromkeys(names))
