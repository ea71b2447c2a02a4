"""Coalesced wakeups: one wakeup on its way per (task, routing key), not one per job.

Rule: a due job is reached by a claim that starts after its row committed. A submit
counts its job on the (task, routing key)'s mark (INCR, after its row committed) and
publishes its kind's wakeup only when its count set the mark (on the direct path one
script counts and pushes: one round trip). A delivery either deletes the mark *before*
it claims (WorkerState.begin), or holds it: once its jobs ran, it deletes the mark only
if the count is still the one it knew before its claim (:meth:`Waking.release`); a count
that moved means submits it must claim for, and a mark gone (lapsed, or deleted) means
one last claim. The count it knows before its first claim is PUSHED, the count of the
submit that published a wakeup, not one it reads: no round trip comes before that claim,
and a count it did not see is only ever too low (submits since the push, even those the
claim took, make it claim once more). Before each later claim it reads the count
(:meth:`Waking.look`). Either way a job whose submit found the mark is committed before
a claim that reads the table after: that claim takes it or, full, wakes the kind again
(worker/many_claim.py). The mark expires after MARK_TTL_MS (HOLD_TTL_MS from a holder's
renewal or last look), so a wakeup lost with its delivery, or a holder whose body runs
long or who died, holds later submits back no longer; the jobs counted meanwhile go to
the next claim of the kind, or to the sweeper. Only kinds whose deliveries claim what is
due take part (``coalesces``); on another broker every wakeup is published.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Collection, Sequence
from typing import Any

from celery import Celery

from celery_lease.broker.redis_direct import COUNT_SETS_MARK, KeptScripts, Mark, RedisDirect

log = logging.getLogger("celery_lease")

#: How long a mark holds submits back if its wakeup is lost (see the module docstring).
MARK_TTL_MS = 2000
#: ... and from a holding delivery's renewal or last look at it: longer than its claims and bodies
#: take between looks (worker/many_claim.py holds only for short bodies), short enough
#: that a body that runs long holds no one back for long.
HOLD_TTL_MS = 250
#: A holder's mark was deleted: no submit came since its last look (Waking.release).
RELEASED = 0
#: The count of a mark whose submit published its wakeup (_COUNT set it): what a
#: holder knows of the count before its first claim without reading it.
PUSHED = "1"
#: One count on a mark; true if it set the mark. KEYS: mark; ARGV: its lifetime in ms.
_COUNT = f"if {COUNT_SETS_MARK} then return 1 end return false"
#: A holder's look: the count, its lifetime renewed. KEYS: mark; ARGV: lifetime in ms.
_LOOK = "local n = redis.call('GET', KEYS[1]) if n then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end return n"
#: A holder's renewal after its first claim. KEYS: mark; ARGV: lifetime in ms.
_RENEW = "return redis.call('PEXPIRE', KEYS[1], ARGV[1])"
#: A holder lets go if the count is the one it saw (0), else returns the count (its
#: lifetime renewed), or nothing if the mark is gone. KEYS: mark; ARGV: the count seen,
#: lifetime in ms.
_RELEASE = (
    "local n = redis.call('GET', KEYS[1]) if not n then return false end"
    " if n == ARGV[1] then redis.call('DEL', KEYS[1]) return 0 end"
    " redis.call('PEXPIRE', KEYS[1], ARGV[2]) return n"
)
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
        (counted: under load most are set, and no message is built for them); one last
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
        """Count on these marks (for wakeups whose mark cannot ride with their push);
        returns those the count set now. Unreadable, every one counts as set: a copy too
        many is harmless."""
        try:
            with self._client() as client:
                if client is None:
                    return keys
                if len(keys) == 1:  # (a submit's: no pipeline to build)
                    answers = [KeptScripts.of(client).eval(_COUNT, keys, [MARK_TTL_MS])]
                else:
                    pipe = client.pipeline(transaction=False)
                    for key in keys:  # (a script in a pipeline costs a SCRIPT EXISTS: sent whole)
                        pipe.eval(_COUNT, 1, key, MARK_TTL_MS)
                    answers = pipe.execute()
        except Exception as exc:
            log.debug("celery-lease: wakeup marks unreadable (%s); published each", type(exc).__name__)
            return keys
        return [key for key, answer in zip(keys, answers) if answer]

    def forget(self, keys: Sequence[str]) -> None:
        """Marks whose wakeup was not published: later submits must publish their own."""
        if keys:
            self._delete(list(keys))

    def mark_of(self, task: str, routing_key: Any) -> str | None:
        """The mark of a delivery of ``task`` with ``routing_key``, if its wakeups coalesce."""
        if self.enabled and isinstance(routing_key, str) and self.coalesces(task):
            return mark_key(task, routing_key)
        return None

    def look(self, key: str) -> str | None:
        """A holder's look before a claim: the mark's count (None: no mark, or unreadable;
        then nothing is held back by it), its lifetime renewed to HOLD_TTL_MS."""
        return self._script(_LOOK, key, HOLD_TTL_MS)

    def renew(self, key: str) -> None:
        """A holder's first claim went: the mark's lifetime renewed to HOLD_TTL_MS (else it
        keeps the one its submit gave it, MARK_TTL_MS)."""
        self._script(_RENEW, key, HOLD_TTL_MS)

    def release(self, key: str, seen: str) -> str | int | None:
        """A holder whose jobs ran: RELEASED if the count is still ``seen`` (the mark is
        deleted: every submit it counted was read by the claims after that look); else
        the count now, or None when the mark is gone (lapsed, deleted, unreadable): the
        jobs counted since ``seen`` are the holder's to claim."""
        return self._script(_RELEASE, key, seen, HOLD_TTL_MS)

    def let_go(self, key: str) -> None:
        """A holder stops holding: the mark goes; its last claim comes after this."""
        self._delete([key])

    def _script(self, script: str, key: str, *args: Any) -> Any:
        try:
            with self._client() as client:
                if client is None:
                    return None
                answer = KeptScripts.of(client).eval(script, [key], args)
        except Exception as exc:
            log.debug("celery-lease: wakeup mark unreadable (%s)", type(exc).__name__)
            return None
        return answer.decode() if isinstance(answer, bytes) else answer

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
