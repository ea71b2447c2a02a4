"""Which of the sweeper's re-sent wakeups are published: a job's copies in the broker stay
bounded (docs/lifecycle.md, "Re-sent wakeups").

The sweeper re-sends a stale wakeup with a backoff (db/statements/maintenance.py,
``_resend_due``). The rule: a re-send is published only when no earlier wakeup of the job
can still be waiting in its queue, as far as the broker tells (one passive declare per
queue and sweep): the queue is empty, or holds fewer messages than this process saw after
its previous look (a consumer is taking them). When the broker cannot tell (it is down,
the route names no single queue), the re-send is published: a copy too many costs a
delivery, a lost wakeup a job. A re-send held back is looked at again after the backoff;
first wakeups (never woken, or came due) are always published.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from typing import Any

log = logging.getLogger("celery_lease")

#: Queues whose last count a process keeps (queue names come from job rows).
MAX_QUEUES = 1000


class ResendGate:
    """The re-sends of one process's sweeps, gated by their queues' message counts.

    ``queue_of(task, queue)``: the broker queue a wakeup goes to (None: not one queue);
    ``waiting(names)``: how many messages wait in each (raises when the broker cannot tell).
    """

    def __init__(
        self, queue_of: Callable[[str, str | None], str | None], waiting: Callable[[Collection[str]], dict[str, int]]
    ) -> None:
        self._queue_of = queue_of
        self._waiting = waiting
        #: Messages each queue held after this process's last look (and its re-sends then).
        self._after: dict[str, int] = {}

    def admit(self, rows: Sequence[Any]) -> list[Any]:
        """The rows to publish: every first wakeup, and the re-sends (``resent``) whose
        queue cannot still hold an earlier copy."""
        out: list[Any] = []
        held: dict[str, list[Any]] = {}
        for row in rows:
            name = self._queue_of(row["task"], row["queue"]) if isinstance(row, dict) and row.get("resent") else None
            if name is None:
                out.append(row)
            else:
                held.setdefault(name, []).append(row)
        if not held:
            return out
        try:
            counts = self._waiting(held)
        except Exception as exc:
            resent = [row for group in held.values() for row in group]
            log.warning("celery-lease: cannot count the queued wakeups (%s); re-sending %d", type(exc).__name__, len(resent))
            for name in held:
                self._after.pop(name, None)
            return out + resent
        if len(self._after) > MAX_QUEUES:
            self._after.clear()
        for name, group in held.items():
            count, before = counts[name], self._after.get(name)
            if count == 0 or (before is not None and count < before):
                out.extend(group)
                count += len(group)
            else:
                log.debug("celery-lease: %d re-send(s) held back: queue %s holds %d, not consumed", len(group), name, count)
            self._after[name] = count
        return out
