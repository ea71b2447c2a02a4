"""Coalesced wakeups: one wakeup on its way per (task, routing key), not one per job.

Rule: a due job is reached by a claim that starts after its row committed. A submit
publishes its kind's wakeup only when it sets the (task, routing key)'s mark (SET NX on
the Redis broker; on the direct path one script sets it and pushes: one round trip); the
delivery deletes the mark *before* it claims (WorkerState.begin).
So a job whose submit found the mark is committed before that claim reads the table:
the claim takes it or, full, wakes the kind again (worker/many_claim.py). The mark expires
after MARK_TTL_MS, so a wakeup lost with its delivery holds later submits back no
longer; the jobs submitted meanwhile are the sweeper's. Only kinds whose deliveries
claim what is due take part (``coalesces``); on another broker every wakeup is published.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Collection, Sequence
from typing import Any

from celery import Celery

from celery_lease.broker.redis_direct import Mark, RedisDirect

log = logging.getLogger("celery_lease")

#: How long a mark holds submits back if its wakeup is lost (see the module docstring).
MARK_TTL_MS = 2000
_PREFIX = "celery-lease:waking:"

Wakeup = tuple[str, str, "str | None"]  # (job id, Celery task name, the row's queue)


def mark_key(task: str, routing_key: str) -> str:
    return f"{_PREFIX}{task}\x00{routing_key}"


class Waking:
    """The marks of one Celery app's wakeups. ``routing_key(task, queue)``: the routing key
    its wakeups are published with (None: not coalesced); ``coalesces(task)``: whether
    that task's deliveries claim what is due (worker/many_claim.py)."""

    def __init__(
        self, app: Celery, routing_key: Callable[[str, str | None], str | None], coalesces: Callable[[str], bool]
    ) -> None:
        self._app = app
        self._routing_key = routing_key
        self.coalesces = coalesces
        self.enabled = _redis_broker(app)
        self._redis: Any = None
        self._pid = 0
        #: Per mark: whether a submit of this process last found it set (see split).
        self._found_set: dict[str, bool] = {}

    def split(self, wakeups: Sequence[Wakeup]) -> tuple[list[Wakeup], dict[str, Mark], list[str]]:
        """The wakeups to publish, the marks that ride with their pushes (job id -> mark:
        pushed only if it sets its mark, Publisher.publish), and the marks set here
        already: of each (task, routing key) that coalesces, one wakeup, if no other is
        on its way; every other wakeup as it is. A mark last found set is asked first
        (SET NX: under load most are set, and no message is built for them); one last
        found free rides with the push (one round trip for a lone submit)."""
        if not self.enabled:
            return list(wakeups), {}, []
        out: list[Wakeup] = []
        groups: dict[str, Wakeup] = {}
        for wakeup in wakeups:
            key = self._key(wakeup[1], wakeup[2])
            if key is None:
                out.append(wakeup)
            elif key not in groups:
                groups[key] = wakeup
        asked = [key for key in groups if self._found_set.get(key)]
        held = list(self.admit(asked)) if asked else []
        for key in asked:
            self._found_set[key] = key not in held
        out.extend(wakeup for key, wakeup in groups.items() if key not in asked or key in held)
        return out, {wakeup[0]: (key, MARK_TTL_MS) for key, wakeup in groups.items() if key not in asked}, held

    def found(self, riding: dict[str, Mark], skipped: Collection[str]) -> None:
        """What the pushes of ``riding`` found: ``skipped``, the job ids whose mark was set."""
        for job_id, (key, _) in riding.items():
            self._found_set[key] = job_id in skipped

    def admit(self, keys: Sequence[str]) -> Collection[str]:
        """Set these marks where free (for wakeups whose mark cannot ride with their push);
        returns those set now. Unreadable, every one counts as set: a copy too many is
        harmless."""
        try:
            with self._client() as client:
                if client is None:
                    return keys
                pipe = client.pipeline(transaction=False)
                for key in keys:
                    pipe.set(key, b"1", nx=True, px=MARK_TTL_MS)
                answers = pipe.execute()
        except Exception as exc:
            log.debug("celery-lease: wakeup marks unreadable (%s); published each", type(exc).__name__)
            return keys
        return [key for key, answer in zip(keys, answers) if answer]

    def forget(self, keys: Sequence[str]) -> None:
        """Marks whose wakeup was not published: later submits must publish their own."""
        if keys:
            self._delete(list(keys))

    def arrived(self, task: str, routing_key: Any) -> None:
        """A delivery of ``task`` with ``routing_key`` is about to claim: its mark goes
        first, so every submit from now on either finds a new mark or publishes."""
        if self.enabled and isinstance(routing_key, str) and self.coalesces(task):
            self._delete([mark_key(task, routing_key)])

    def _key(self, task: str, queue: str | None) -> str | None:
        if not self.coalesces(task):
            return None
        routing_key = self._routing_key(task, queue)
        return None if routing_key is None else mark_key(task, routing_key)

    def _delete(self, keys: list[str]) -> None:
        try:
            with self._client() as client:
                if client is not None:
                    client.delete(*keys)
        except Exception as exc:
            # The mark lapses by itself within MARK_TTL_MS; meanwhile later submits may
            # leave their jobs to the claims already woken, or to the sweeper.
            log.warning("celery-lease: wakeup mark not cleared (%s); it lapses in %d ms", type(exc).__name__, MARK_TTL_MS)

    @contextlib.contextmanager
    def _client(self):
        """The broker's Redis client (the one direct wakeups use), kept per process: taking
        it from the app's producer pool costs more than the command. Dropped on an error,
        to be taken afresh (a broker restart)."""
        if self._redis is None or self._pid != os.getpid():
            with self._app.producer_or_acquire() as producer:
                direct = RedisDirect.of(producer)
                self._redis, self._pid = (None if direct is None else direct.client), os.getpid()
        try:
            yield self._redis
        except Exception:
            self._redis = None
            raise


def _redis_broker(app: Celery) -> bool:
    url = app.conf.broker_url
    return isinstance(url, str) and url.split("://", 1)[0] in ("redis", "rediss") and ";" not in url
