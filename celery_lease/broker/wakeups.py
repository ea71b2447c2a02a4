"""Publishing wakeups: one Celery task message per job, whose task id is the job id.

A wakeup carries no payload (the row has it); losing, duplicating or delaying one never
loses, duplicates or corrupts a job, because the claim decides who runs it. The rule: the
message on the broker is the one ``send_task(task, task_id=job_id, queue=queue,
ignore_result=True)`` would publish (tests/integration/test_submit_perf.py compares
them), with the same publish signals; a :class:`Publisher` only builds the route, header
template and body once per (task, queue) and process. Settings the template cannot
honour (sent events, ``task_sent``, protocol 1, per-task ``expires``, inherited priority)
take ``send_task`` per message. The route is asked of ``task_routes`` once per process,
so a router answering differently from call to call for the same task is not supported.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from celery import Celery, signals
from kombu import serialization
from kombu.common import Broadcast

from celery_lease.broker.redis_direct import Mark, RedisDirect

#: Short retries: a broker that is down must not hold up submit; the sweeper delivers.
RETRY_POLICY = {"max_retries": 2, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.5}

Wakeup = tuple[str, str, "str | None"]  # (job id, Celery task name, queue)

# What send_task_message takes by name; whatever else a route holds becomes a message
# property, as there (e.g. priority).
_NAMED = {"exchange", "routing_key", "queue", "serializer", "delivery_mode", "compression", "declare", "exchange_type"}
# Route options the template cannot carry: send_task per message for these.
_DYNAMIC = {"expires", "countdown", "eta", "headers", "retry", "retry_policy", "event_dispatcher", "timeout", "confirm_timeout"}


@dataclass(frozen=True)
class _Route:
    """Everything about one (task, queue)'s wakeups that does not depend on the job."""

    task: str
    exchange: Any  # a name or a kombu Exchange, as the route gave it
    routing_key: Any
    declare: list
    headers: dict[str, Any]  # the as_task_v2 headers, id and root_id to fill in
    properties: dict[str, Any]  # message properties beyond correlation_id / reply_to
    body: tuple  # (args, kwargs, embed)
    data: str  # the body serialized, or "" when it must be serialized per message
    content_type: str | None
    content_encoding: str | None
    publish: dict[str, Any]  # delivery_mode, serializer, compression
    retry_policy: dict[str, Any]


#: Routes (task, queue) a Publisher keeps; more distinct ones start the cache afresh.
MAX_ROUTES = 256


class Publisher:
    """Publishes wakeups for one Celery app; routes and templates are built once per
    process (the template's ``origin`` header names the process)."""

    def __init__(self, app: Celery) -> None:
        self._app = app
        self._routes: dict[tuple[str, str | None], _Route | None] = {}
        self._pid = os.getpid()

    def publish(
        self,
        wakeups: Sequence[Wakeup],
        marks: Mapping[str, Mark] | None = None,
        admit: Callable[[list[str]], Collection[str]] | None = None,
    ) -> set[str]:
        """Publish (job_id, task name, queue) wakeups; raises when the broker fails.

        ``marks`` (job id -> mark, broker/waking.py): such a wakeup goes only if it sets
        its mark, in the same round trip as its push on the direct path; any other path
        asks ``admit(keys)`` first (the keys it set). Returns the job ids not published
        because their mark was set. On an error nothing is known to be delivered, so the
        caller treats every wakeup as lost; re-sending one that did arrive is harmless.
        """
        if not wakeups:
            return set()
        if os.getpid() != self._pid:  # the template's origin header names the process
            self._routes.clear()
            self._pid = os.getpid()
        app = self._app
        with app.producer_or_acquire() as producer:
            retry = bool(app.conf.task_publish_retry)
            direct = RedisDirect.of(producer)
            batch = getattr(producer, "batch", None)
            marks = marks or {}
            skipped: set[str] = set()
            if marks and (direct is None or not self._direct_routes(direct, wakeups, marks)):
                admitted = _admitted(wakeups, marks, admit)
                skipped = {w[0] for w in wakeups} - {w[0] for w in admitted}
                wakeups, marks = admitted, {}
            if len(wakeups) == 1 or batch is None or direct is not None:
                return skipped | self._send(producer, wakeups, retry=retry, direct=direct, marks=marks)
            # Buffered: a retry per message would guard nothing; the flush fails as a whole.
            with batch():
                self._send(producer, wakeups, retry=False, direct=None)
            return skipped

    def _direct_routes(self, direct: RedisDirect, wakeups: Sequence[Wakeup], marks: Mapping[str, Mark]) -> bool:
        """Whether every marked wakeup takes the direct path (its mark then set with its push)."""
        if self._slow() or signals.before_task_publish.receivers:  # a receiver may change the body
            return False
        for job_id, task, queue in wakeups:
            if job_id in marks:
                route = self._route(task, queue)
                if route is None or not direct.routes_directly(route):
                    return False
        return True

    def _slow(self) -> bool:
        """Settings the template cannot honour: send_task per message."""
        conf = self._app.conf
        slow = conf.task_send_sent_event or conf.task_protocol != 2 or bool(signals.task_sent.receivers)
        return slow or (self._app.current_worker_task is not None and conf.task_inherit_parent_priority)

    def _send(
        self,
        producer,
        wakeups: Sequence[Wakeup],
        *,
        retry: bool,
        direct: RedisDirect | None,
        marks: Mapping[str, Mark] | None = None,
    ) -> set[str]:
        app = self._app
        parent = app.current_worker_task
        slow = self._slow()
        marks = marks or {}
        root_id = parent_id = None
        if parent is not None:
            # Message headers: a forged one may hold anything (a wakeup with one is
            # refused, but a plain task's is not checked); only strings are handed on.
            root_id = _task_id(parent.request.root_id) or _task_id(parent.request.id)
            parent_id = _task_id(parent.request.id)
        reply_to = app.thread_oid
        before = signals.before_task_publish.send
        after = signals.after_task_publish.send
        declared: set[tuple[str, str | None]] = set()
        sent: list[tuple[str, Any, dict, _Route]] = []  # sent directly: after_task_publish once flushed
        for job_id, task, queue in wakeups:
            route = None if slow else self._route(task, queue)
            if route is None:
                _send_task(app, producer, job_id, task, queue, declare=(task, queue) not in declared)
                declared.add((task, queue))
                continue
            headers = dict(route.headers)
            headers["id"] = job_id
            headers["root_id"] = root_id or job_id
            headers["parent_id"] = parent_id
            # The template's mutable values are not shared with receivers of the signal.
            headers["timelimit"] = list(headers["timelimit"])
            headers["stamps"] = {}
            properties = {"correlation_id": job_id, "reply_to": reply_to, **route.properties}
            # The first message to a destination declares its queue and binding (the Redis
            # transport routes through them), unless this connection has already declared
            # them; repeating that per message only costs time.
            declare = [] if (task, queue) in declared else _undeclared(producer, route.declare)
            declared.add((task, queue))
            receivers = bool(signals.before_task_publish.receivers)
            body = route.body if not receivers else (route.body[0], dict(route.body[1]), dict(route.body[2]))
            before(
                sender=task,
                body=body,
                exchange=route.exchange,
                routing_key=route.routing_key,
                declare=declare,
                headers=headers,
                properties=properties,
                retry_policy=route.retry_policy,
            )
            if route.data and not receivers:
                content = {"content_type": route.content_type, "content_encoding": route.content_encoding}
                payload: Any = route.data
            else:  # a receiver may have changed the body: serialize what it left
                content, payload = {}, body

            # Built only when called (the direct path calls it only if its flush fails):
            # merging a dozen keyword arguments per wakeup is a reaped lease's cost.
            def kombu_publish(declare, payload=payload, route=route, headers=headers, properties=properties, content=content):
                return producer.publish(
                    payload,
                    exchange=route.exchange,
                    routing_key=route.routing_key,
                    headers=headers,
                    retry=retry,
                    retry_policy=route.retry_policy,
                    declare=declare,
                    **content,
                    **route.publish,
                    **properties,
                )

            mark = marks.get(job_id)
            if direct is not None and payload is route.data and direct.add(route, headers, properties, kombu_publish, mark):
                for entity in declare:
                    producer.maybe_declare(entity, retry=retry, **route.retry_policy)
                sent.append((task, body, headers, route))
                continue
            kombu_publish(declare=declare)
            after(sender=task, body=body, headers=headers, exchange=route.exchange, routing_key=route.routing_key)
        pushed = direct.flush() if direct is not None else []
        skipped = set()
        for (task, body, headers, route), went in zip(sent, pushed):
            if not went:  # its mark was set: a wakeup of its kind is on its way
                skipped.add(headers["id"])
                continue
            after(sender=task, body=body, headers=headers, exchange=route.exchange, routing_key=route.routing_key)
        return skipped

    def queue_of(self, task: str, queue: str | None) -> str | None:
        """The broker queue a (task, queue)'s wakeups go to; None when the route names
        not exactly one queue (a topic exchange, a route decided per message)."""
        route = self._route(task, queue)
        names = {getattr(entity, "name", None) for entity in (route.declare if route is not None else ())}
        return names.pop() if len(names) == 1 else None

    def routing_key(self, task: str, queue: str | None) -> str | None:
        """The routing key a (task, queue)'s wakeups are published with to the nameless
        exchange (straight to one queue), which the delivery carries back; None for any
        other route (broker/waking.py coalesces only these)."""
        route = self._route(task, queue)
        if route is None or route.exchange != "" or not isinstance(route.routing_key, str):
            return None
        return route.routing_key

    def waiting(self, names: Collection[str]) -> dict[str, int]:
        """How many messages wait in each of these broker queues (one passive declare
        each; a queue the broker does not know holds none). Raises when it cannot tell."""
        counts: dict[str, int] = {}
        with self._app.pool.acquire(block=True, timeout=5) as conn:
            for name in names:
                channel = conn.channel()
                try:
                    counts[name] = channel.queue_declare(queue=name, passive=True).message_count
                except conn.channel_errors as exc:
                    if "404" not in str(getattr(exc, "reply_code", "")) and "NOT_FOUND" not in str(exc):
                        raise
                    counts[name] = 0  # (a Redis list is gone once empty; AMQP: never declared)
                finally:
                    with contextlib.suppress(Exception):  # (AMQP closed it already after a 404)
                        channel.close()
        return counts

    def _route(self, task: str, queue: str | None) -> _Route | None:
        key = (task, queue)
        if key not in self._routes:
            if len(self._routes) >= MAX_ROUTES:
                # Bounded whatever queue names reach it (they come from job rows, set at
                # submit; a flood of distinct ones must not grow a worker without end).
                self._routes.clear()
            self._routes[key] = _build_route(self._app, task, queue)
        return self._routes[key]


def _task_id(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _build_route(app: Celery, task: str, queue: str | None) -> _Route | None:
    """What app.send_task(task, queue=queue) and amqp.send_task_message work out per call,
    worked out once; None when something varies per message (send_task then)."""
    amqp = app.amqp
    conf = app.conf
    task_type = app._tasks.get(task)  # as send_task: without finalizing the app
    options: dict[str, Any] = {}
    get_exec_options = getattr(task_type, "_get_exec_options", None)
    if get_exec_options is not None:
        options = {k: v for k, v in get_exec_options().items() if v is not None}
    options["queue"] = queue  # send_task(queue=None) overrides a task-level queue too
    time_limit = options.pop("time_limit", None)
    soft_time_limit = options.pop("soft_time_limit", None)
    options.pop("ignore_result", None)
    if options.get("expires") is not None:
        return None
    options.pop("expires", None)
    options = amqp.router.route(options, task, (), {}, task_type)
    if _DYNAMIC & set(options):
        return None
    named = {k: options.pop(k) for k in list(options) if k in _NAMED}
    exchange, routing_key = named.get("exchange"), named.get("routing_key")
    target: Any = named.get("queue")
    qname = target
    if target is None and exchange is None:
        target = amqp.default_queue
    if target is not None:
        if isinstance(target, str):
            qname, target = target, amqp.queues[target]
        else:
            qname = target.name
    delivery_mode = named.get("delivery_mode")
    if delivery_mode is None:
        delivery_mode = _exchange_attr(target, "delivery_mode", None) or conf.task_default_delivery_mode
    exchange_type = named.get("exchange_type")
    if exchange_type is None:
        exchange_type = _exchange_attr(target, "type", "direct")
    if (not exchange or not routing_key) and exchange_type == "direct":
        exchange, routing_key = "", qname
    elif exchange is None:
        exchange = target.exchange.name or amqp.default_exchange
        routing_key = routing_key or target.routing_key or conf.task_default_routing_key
    declare = named.get("declare")
    if declare is None and target and not isinstance(target, Broadcast):
        declare = [target]
    serializer = named.get("serializer") or conf.task_serializer
    compression = named.get("compression") or conf.task_compression
    message = amqp.as_task_v2(
        "",
        task,
        (),
        {},
        time_limit=time_limit,
        soft_time_limit=soft_time_limit,
        ignore_result=True,
    )
    data, content_type, content_encoding = "", None, None
    if not compression:
        content_type, content_encoding, data = serialization.dumps(message.body, serializer=serializer)
    return _Route(
        task=task,
        exchange=exchange,
        routing_key=routing_key,
        declare=list(declare or []),
        headers=message.headers,
        properties=dict(options),
        body=message.body,
        data=data,
        content_type=content_type,
        content_encoding=content_encoding,
        publish={"delivery_mode": delivery_mode, "serializer": serializer, "compression": compression},
        retry_policy=dict(conf.task_publish_retry_policy or {}, **RETRY_POLICY),
    )


def _undeclared(producer, entities: list) -> list:
    """The entities this producer's connection has not declared yet: kombu's own cache
    of declarations (kombu.common._maybe_declare's test, without binding a copy of each
    entity first), which kombu empties when the connection is re-established."""
    if not entities:
        return entities
    try:
        cache = producer.channel.connection.client.declared_entities
    except AttributeError:  # a transport without the cache: let kombu decide each time
        return entities
    return [e for e in entities if not (e.can_cache_declaration and hash(e) in cache)]


def _exchange_attr(queue: Any, name: str, default: Any) -> Any:
    """``queue.exchange.<name>``, or ``default`` where send_task_message's try/except
    AttributeError falls back."""
    try:
        return getattr(queue.exchange, name)
    except AttributeError:
        return default


def _admitted(wakeups: Sequence[Wakeup], marks: Mapping[str, Mark], admit) -> list[Wakeup]:
    """The wakeups to send where a mark cannot ride with its push: each marked one only
    if ``admit`` set its mark."""
    assert admit is not None, "marked wakeups need admit"
    set_now = set(admit([mark[0] for mark in marks.values()]))
    return [w for w in wakeups if w[0] not in marks or marks[w[0]][0] in set_now]


def _send_task(app: Celery, producer, job_id: str, task: str, queue: str | None, *, declare: bool) -> None:
    options: dict[str, Any] = {} if declare else {"declare": []}
    app.send_task(
        task,
        task_id=job_id,
        queue=queue,
        producer=producer,
        add_to_parent=False,
        ignore_result=True,
        retry_policy=RETRY_POLICY,
        **options,
    )
