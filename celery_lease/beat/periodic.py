"""Leased jobs in the beat schedule, one job per schedule slot.

``leases.periodic(name, task, every, payload)`` adds a beat entry that targets the small
task ``celery_lease.beat_submit``. When beat fires the entry, that task's
``apply_async`` runs *in the beat process* and fixes the slot from the tick's own time;
a worker then submits the job with the idempotency key ``beat:{name}:{slot start}``.
Several beat processes firing the same slot therefore submit one job: the second
submit of a (kind, key) returns the first job and stores nothing.

Slots:

* interval schedules (seconds, ``timedelta``, ``celery.schedules.schedule``): slots are
  aligned to the Unix epoch, ``[k * period, (k + 1) * period)``, so beats started at
  different moments agree on them;
* ``crontab``: the minute the tick fires in (a crontab fires at most once a minute).

Limits, stated plainly: a slot is at most once, not exactly once. A tick that never
reaches a worker (message lost) leaves its slot unrun, like any beat tick. The beat
hosts' clocks must agree to well within the period, and a beat stalled past its slot's
end gives its late tick the next slot (run once, like any other).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

from celery import Celery, Task
from celery.schedules import BaseSchedule, crontab, schedule

from celery_lease.errors import ConfigurationError
from celery_lease.kinds import JobKind, Registry

if TYPE_CHECKING:
    from celery_lease.job import Job
    from celery_lease.producer import Producer

BEAT_SUBMIT_TASK = "celery_lease.beat_submit"
#: The idempotency key column holds 255 characters; the slot's ISO time takes 32.
MAX_NAME_LENGTH = 200


@dataclass(frozen=True)
class Periodic:
    """One leased job kind in the beat schedule."""

    name: str
    kind: JobKind
    schedule: BaseSchedule
    payload: Any  # already validated and serialized

    def slot_start(self, now: float) -> datetime:
        """The start of the slot that a tick fired at ``now`` (Unix time) belongs to."""
        if isinstance(self.schedule, crontab):
            return datetime.fromtimestamp(now // 60 * 60, timezone.utc)
        period = self.schedule.run_every.total_seconds()
        return datetime.fromtimestamp(math.floor(now / period) * period, timezone.utc)

    def slot_key(self, now: float) -> str:
        return f"beat:{self.name}:{self.slot_start(now).isoformat()}"


def _as_schedule(every: Any, app) -> BaseSchedule:
    if isinstance(every, crontab):
        return every
    if isinstance(every, (int, float)) and not isinstance(every, bool):
        every = timedelta(seconds=every)
    if isinstance(every, timedelta):
        every = schedule(run_every=every, app=app)
    if isinstance(every, schedule):
        if every.run_every.total_seconds() <= 0:
            raise ValueError("a periodic job's interval must be positive")
        return every
    raise TypeError(
        f"a periodic job runs on seconds, a timedelta, celery.schedules.schedule or crontab, not {type(every).__name__}"
    )


class BeatSubmitTask(Task):
    """The task beat sends for a periodic leased job."""

    #: Its return value only goes to the worker log.
    ignore_result = True
    beat_jobs: BeatJobs

    def apply_async(self, args=None, kwargs=None, **options):
        # Beat calls this in its own process at the tick: the slot is taken from the
        # tick's time, not from when a worker gets to the message, so a message that
        # waited in the queue still submits its own slot and no other.
        name = tuple(args)[0]
        key = self.beat_jobs.entry(name).slot_key(time.time())
        return super().apply_async((name, key), None, **options)


def beat_submit(self: BeatSubmitTask, name: str, key: str) -> dict[str, str]:
    job = self.beat_jobs.submit(name, key)
    return {"job": job.id, "key": key}


class BeatJobs:
    """The periodic leased jobs of one CeleryLease, and the task that submits them."""

    def __init__(
        self,
        app: Celery,
        registry: Registry,
        producer: Callable[[], Producer],
        keep_entry: Callable[[str, dict], None],
    ) -> None:
        self._app = app
        self._registry = registry
        self._producer = producer
        #: Keeps an entry in the beat schedule across later configuration (beat/entries.py).
        self._keep_entry = keep_entry
        self._entries: dict[str, Periodic] = {}
        app.task(
            name=BEAT_SUBMIT_TASK,
            base=BeatSubmitTask,
            bind=True,
            shared=False,
            _force_evaluate=True,
            beat_jobs=self,
        )(beat_submit)

    def add(self, name: str, task: Any, every: Any, payload: Any = None) -> Periodic:
        if not isinstance(name, str) or not name or len(name) > MAX_NAME_LENGTH:
            raise ValueError(f"a periodic job's name must be 1 to {MAX_NAME_LENGTH} characters")
        if name in self._entries:
            raise ValueError(f"periodic job {name!r} is already scheduled")
        spec = self._registry.resolve(task)
        payload = {} if payload is None else payload  # a job always has a payload
        # Validated with the codec alone: the producer reads the app's settings, and a
        # periodic job is usually declared at import, before the project configures the app.
        entry = Periodic(name, spec, _as_schedule(every, self._app), spec.codec.dump_payload(payload))
        self._entries[name] = entry
        self._keep_entry(name, {"task": BEAT_SUBMIT_TASK, "schedule": entry.schedule, "args": (name,)})
        return entry

    def entry(self, name: str) -> Periodic:
        try:
            return self._entries[name]
        except KeyError:
            raise ConfigurationError(
                f"no periodic job {name!r} in this process: beat and workers must run the same app module"
            ) from None

    def submit(self, name: str, key: str) -> Job:
        """Submit ``name``'s job for the slot ``key``; a second call returns the same job."""
        entry = self.entry(name)
        return self._producer().submit_many(entry.kind, [entry.payload], idempotency_keys=[key])[0]
