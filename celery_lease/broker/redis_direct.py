"""Wakeups written straight to kombu's Redis transport (see :class:`RedisDirect`): the
fast path of :class:`celery_lease.broker.wakeups.Publisher` for the common case, a queue on
kombu's Redis transport. Its messages are those ``Producer.publish`` would write;
``tests/integration/test_submit_perf.py`` compares them with ``send_task``'s.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
import uuid
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from kombu.entity import maybe_delivery_mode
from kombu.utils import json as kombu_json
from kombu.utils.uuid import uuid as kombu_uuid

#: Stands for a per-message value in a direct wakeup's message template; random, so no
#: task name, queue or header can contain it.
_TOKEN = uuid.uuid4().hex
_SLOT_RE = re.compile('"' + _TOKEN + r'(\w+)"')
#: Messages per LPUSH: a command stays small enough for Redis' query buffer however
#: large the batch (one maintenance batch is up to batch_size wakeups).
LPUSH_CHUNK = 500
#: A submit's count on a coalesced wakeup's mark (broker/waking.py), true if it set the
#: mark (then with its lifetime): the one rule, in both scripts that count. KEYS[1]: the
#: mark; ARGV[1]: its lifetime in ms.
COUNT_SETS_MARK = "redis.call('INCR', KEYS[1]) == 1 and redis.call('PEXPIRE', KEYS[1], ARGV[1]) == 1"
#: A coalesced wakeup: its mark counted and its message pushed in one round trip, the
#: message only if this count set the mark. KEYS: mark, list; ARGV: the mark's lifetime in
#: ms, the message.
PUSH_IF_MARKED = f"if {COUNT_SETS_MARK} then return redis.call('LPUSH', KEYS[2], ARGV[2]) end return false"
#: A coalesced wakeup's mark: (its Redis key, its lifetime in ms).
Mark = tuple[str, int]


def _slot(name: str) -> str:
    return _TOKEN + name


def _json_str(value: str | None) -> str:
    """A string (or None) as JSON, the cheap way for a UUID-like id."""
    if value is None:
        return "null"
    if value.isascii() and value.isprintable() and '"' not in value and "\\" not in value:
        return '"' + value + '"'
    return kombu_json.dumps(value)


class RedisDirect:
    """Wakeups written straight to kombu's Redis transport, as its own publish would.

    For a message to the nameless exchange (a queue's direct route, every default
    wakeup), ``Producer.publish`` -> ``Channel.basic_publish`` -> ``Channel._put``
    builds a dict, base64-encodes the body, adds a delivery tag and LPUSHes its JSON to
    the queue's (priority) list, making a Redis client per message. Here the same
    message is built from the route's template with the channel's own encoding and
    priority rules, and the wakeups of one call go out in one pipelined round trip on a
    client kept per channel. Anything else (a named exchange, a queue with an expiry, a
    key prefix, another transport) takes ``Producer.publish``; if the pipeline fails, its
    messages are published again that way, with the retry policy (a duplicate wakeup is
    harmless).
    """

    _clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    #: Per channel: id(route) -> (route, its queue's list key, the message's JSON split
    #: at the per-message values), or (route, None, None) when the route cannot go direct.
    _templates: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(self, producer: Any, client: Any) -> None:
        self._channel = producer.channel
        self._client = client
        self._delivery_mode = producer.exchange.delivery_mode  # Producer._delivery_details' default
        self._routes = self._templates.setdefault(self._channel, {})
        #: (list key, message, its kombu publish, its mark or None)
        self._pending: list[tuple[str, str, Callable[..., Any], Mark | None]] = []
        self._tag_base = kombu_uuid()[:-8]
        self._tags = 0

    @property
    def client(self) -> Any:
        """The Redis client this channel's direct wakeups use."""
        return self._client

    @classmethod
    def of(cls, producer: Any) -> RedisDirect | None:
        channel = producer.channel
        if type(channel).__module__ != "kombu.transport.redis" or getattr(channel, "global_keyprefix", None):
            return None
        client = cls._clients.get(channel)
        if client is None:
            client = cls._clients[channel] = channel.Client(connection_pool=channel.pool)
        return cls(producer, client)

    def _template(self, route: Any, properties: dict) -> tuple[str | None, str | None]:
        """The message of a route's wakeups, built once per channel: everything but the
        values named by _SLOTS is the same for every wakeup of the route (the headers and
        properties Publisher._send adds are those)."""
        entry = self._routes.get(id(route))
        if entry is not None and entry[0] is route:
            return entry[1], entry[2]
        channel = self._channel
        queue = route.routing_key
        props = {**properties, "correlation_id": _slot("job_id"), "reply_to": _slot("reply_to")}
        priority = props.pop("priority", 0)  # Producer.publish takes it by name
        direct = route.exchange == "" and isinstance(queue, str) and "expiration" not in props
        if not direct or queue in (getattr(channel, "_expires", None) or {}):
            self._routes[id(route)] = (route, None, None)
            return None, None
        props["delivery_mode"] = maybe_delivery_mode(route.publish["delivery_mode"] or self._delivery_mode)
        props["delivery_info"] = {"exchange": "", "routing_key": queue}
        props["priority"] = priority or channel.default_priority
        data = route.data.encode(route.content_encoding or "utf-8")
        body, props["body_encoding"] = channel.encode_body(data, channel.body_encoding)
        props["delivery_tag"] = _slot("delivery_tag")
        headers = {**route.headers, "id": _slot("job_id"), "root_id": _slot("root_id"), "parent_id": _slot("parent_id")}
        headers["timelimit"] = list(headers["timelimit"])
        headers["stamps"] = {}
        message = {
            "body": body,
            "content-encoding": route.content_encoding,
            "content-type": route.content_type,
            "headers": headers,
            "properties": props,
        }
        key = channel._q_for_pri(queue, channel._get_message_priority(message, reverse=False))
        # [text, slot name, text, slot name, ..., text] -> one %-format: C fills it in.
        parts = _SLOT_RE.split(kombu_json.dumps(message))
        text = "".join(f"%({part})s" if i % 2 else part.replace("%", "%%") for i, part in enumerate(parts))
        self._routes[id(route)] = (route, key, text)
        return key, text

    def routes_directly(self, route: Any) -> bool:
        """Whether ``route``'s wakeups are written here (else Producer.publish)."""
        properties = {"correlation_id": None, "reply_to": None, **route.properties}
        return bool(route.data) and self._template(route, properties)[0] is not None

    def add(
        self, route: Any, headers: dict, properties: dict, kombu_publish: Callable[..., Any], mark: Mark | None = None
    ) -> bool:
        """Queue one wakeup's message (with ``mark``: pushed only if it sets that mark);
        False when it must take Producer.publish."""
        key, text = self._template(route, properties)
        if key is None or text is None:
            return False
        values = {
            "job_id": _json_str(headers["id"]),
            "root_id": _json_str(headers["root_id"]),
            "parent_id": _json_str(headers["parent_id"]),
            "reply_to": _json_str(properties.get("reply_to")),
            "delivery_tag": self._delivery_tag(),
        }
        message = text % values
        self._pending.append((key, message, kombu_publish, mark))
        return True

    def _delivery_tag(self) -> str:
        """A UUID4-shaped tag, unique as kombu's (a fresh uuid4 per message): the random
        part of one uuid4 per call, its last 32 bits a counter (uuid4 costs a syscall)."""
        self._tags += 1
        return f'"{self._tag_base}{self._tags:08x}"'

    def flush(self) -> list[bool]:
        """Push what was added, in one round trip; returns, per message added, whether it
        was pushed (False: its mark was already set). On a Redis error each goes by
        Producer.publish instead, unconditionally (a copy too many is harmless)."""
        pending, self._pending = self._pending, []
        if not pending:
            return []
        # One LPUSH per list and chunk, not per message: LPUSH k m1 m2 leaves the list
        # as LPUSH k m1; LPUSH k m2 would (m1 is consumed first), at a fraction of the
        # client's packing and the server's parsing (100k reaped leases: 100k commands).
        by_key: dict[str, list[str]] = {}
        for key, message, _, mark in pending:
            if mark is None:
                by_key.setdefault(key, []).append(message)
        commands = [(key, ms[i : i + LPUSH_CHUNK]) for key, ms in by_key.items() for i in range(0, len(ms), LPUSH_CHUNK)]
        marked = [(key, message, mark) for key, message, _, mark in pending if mark is not None]
        try:
            if len(pending) == 1:  # a pipeline of one costs more than the command
                key, message, _, mark = pending[0]
                client = self._client
                if mark is None:
                    answers = [client.lpush(key, message)]
                else:
                    answers = [KeptScripts.of(client).eval(PUSH_IF_MARKED, [mark[0], key], [mark[1], message])]
            else:
                with self._client.pipeline(transaction=False) as pipe:
                    for key, messages in commands:
                        pipe.lpush(key, *messages)
                    for key, message, mark in marked:
                        pipe.eval(PUSH_IF_MARKED, 2, mark[0], key, mark[1], message)
                    answers = pipe.execute()[len(commands) :]
        except Exception:
            self._clients.pop(self._channel, None)
            for _, _, kombu_publish, _ in pending:
                kombu_publish(declare=[])
            return [True] * len(pending)
        pushed = iter(answer is not None for answer in answers)
        return [True if mark is None else next(pushed) for _, _, _, mark in pending]


class KeptScripts:
    """Scripts run on one connection that a process keeps from its client's pool: a
    submit's count, a holder's look, renewal and release (broker/waking.py), one or two
    per job. The client's own call takes a connection from the pool and gives it back,
    behind retry and instrumentation wrappers: twice the round trip's own cost (redis-py
    8: ~145 us against ~60 us on a small machine).

    A connection a thread is using is not waited for: that call goes the client's way.
    A call whose connection fails goes the client's way too (its retries), so a script
    may run twice when its reply was lost: each one here is harmless twice (a count too
    many makes a holder claim once more; a push that finds the mark set pushes nothing;
    a release that finds the mark gone makes one last claim)."""

    _of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(self, client: Any) -> None:
        # (redis is loaded with the client; imported here, a submit that never reaches
        # the broker loads none of it, nor what it loads: OpenTelemetry, redis-py 8)
        from redis import exceptions

        self._no_answer = (exceptions.ConnectionError, exceptions.TimeoutError, OSError)
        self._no_script = exceptions.NoScriptError
        self._client = client
        self._lock = threading.Lock()
        self._conn: Any = None
        self._pid = 0
        self._sha: dict[str, str] = {}

    @classmethod
    def of(cls, client: Any) -> KeptScripts:
        kept = cls._of.get(client)
        if kept is None:
            kept = cls._of[client] = cls(client)
        return kept

    def eval(self, script: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """``script``'s answer, as ``client.eval`` gives it (raises its errors)."""
        if self._lock.acquire(blocking=False):
            try:
                return self._on_kept(script, keys, args)
            except self._no_answer:
                self._drop()
            finally:
                self._lock.release()
        return self._client.eval(script, len(keys), *keys, *args)

    def _on_kept(self, script: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        if self._conn is None or self._pid != os.getpid():
            # (After a fork the parent's connection is its own: left alone, not closed.)
            self._conn, self._pid = _connection_of(self._client.connection_pool), os.getpid()
        sha = self._sha.get(script)
        if sha is None:
            sha = self._sha[script] = hashlib.sha1(script.encode()).hexdigest()
        conn = self._conn
        conn.send_command("EVALSHA", sha, len(keys), *keys, *args)
        try:
            return conn.read_response()
        except self._no_script:  # not loaded yet, or a restarted Redis: sent whole once
            conn.send_command("EVAL", script, len(keys), *keys, *args)
            return conn.read_response()

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and self._pid == os.getpid():
            conn.disconnect()
            self._client.connection_pool.release(conn)


def _connection_of(pool: Any) -> Any:
    try:
        return pool.get_connection()
    except TypeError:  # redis-py before 6 names the command
        return pool.get_connection("EVALSHA")
