"""Leased jobs in the beat schedule, one job per schedule slot.

``leases.periodic(name, task, every, payload)`` adds a beat entry for the task
``celery_lease.beat_submit``, stamped with the tick's time in the beat process; a worker
derives the slot from the entry's schedule and that time and submits the job with the
idempotency key ``beat:{name}:{slot start}``, so several beats firing one slot submit
one job. Interval slots are aligned to the Unix epoch; a crontab's slot is the minute
the tick fires in. A tick is untrusted input: the worker takes no key from it and
refuses one of an unknown entry, older than :data:`MAX_TICK_AGE`, further ahead than
:data:`MAX_CLOCK_SKEW` or off its crontab (:data:`CRON_GRACE`), so a forged tick can at
most submit a slot due now. A slot runs at most once, not exactly once.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

from celery import Celery, Task, signals
from celery.exceptions import Ignore
from celery.schedules import BaseSchedule, crontab, schedule

from celery_lease.errors import ConfigurationError, UnknownKind
from celery_lease.kinds import JobKind, Registry

if TYPE_CHECKING:
    from celery_lease.job import Job
    from celery_lease.producer import Producer

BEAT_SUBMIT_TASK = "celery_lease.beat_submit"
#: The idempotency key column holds 255 characters; the slot's ISO time takes 32.
MAX_NAME_LENGTH = 200
#: A tick that waited longer than this (seconds) in the queue is refused.
MAX_TICK_AGE = 3600.0
#: How far ahead of a worker's clock a beat's clock may run (seconds).
MAX_CLOCK_SKEW = 60.0
#: A crontab tick may come this many minutes after a minute the crontab fires in.
CRON_GRACE = 5

log = logging.getLogger("celery_lease.beat")


class TickRefused(ValueError):
    """A beat_submit message that is not a tick of this app's schedule."""


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

    def fires_near(self, tick: float) -> bool:
        """True when the schedule fires in the tick's minute or up to CRON_GRACE
        minutes before it (every tick of an interval schedule is in some slot)."""
        cron = self.schedule
        if not isinstance(cron, crontab):
            return True
        start = datetime.fromtimestamp(tick // 60 * 60, timezone.utc)
        for back in range(CRON_GRACE + 1):
            at = (start - timedelta(minutes=back)).astimezone(cron.tz)
            if (
                at.minute in cron.minute
                and at.hour in cron.hour
                and at.day in cron.day_of_month
                and at.month in cron.month_of_year
                and at.isoweekday() % 7 in cron.day_of_week  # crontab counts Sunday as 0
            ):
                return True
        return False

    def tick_key(self, tick: Any, now: float) -> str:
        """The idempotency key of the slot a tick stamped ``tick`` belongs to, derived
        here from the schedule; raises TickRefused for a tick beat could not have sent."""
        if isinstance(tick, str):
            tick = self._legacy_tick(tick)
        if isinstance(tick, bool) or not isinstance(tick, (int, float)) or not math.isfinite(tick):
            raise TickRefused("the tick time is not a number")
        if not now - MAX_TICK_AGE <= tick <= now + MAX_CLOCK_SKEW:
            raise TickRefused(f"the tick time is not within {MAX_TICK_AGE:.0f}s before or {MAX_CLOCK_SKEW:.0f}s after now")
        if not self.fires_near(tick):
            raise TickRefused("the crontab does not fire at the tick time")
        return self.slot_key(tick)

    def _legacy_tick(self, key: str) -> float:
        """A tick from an older beat, which sent its slot key: accepted only when it is
        exactly the key of a slot of this schedule; the slot start is the tick time."""
        prefix = f"beat:{self.name}:"
        try:
            start = datetime.fromisoformat(key[len(prefix) :]).timestamp() if key.startswith(prefix) else None
        except ValueError:
            start = None
        if start is None or self.slot_key(start) != key:
            raise TickRefused("the slot key is not one of this schedule's")
        return start


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
        # Beat calls this in its own process at the tick: the message carries the
        # tick's time, not a key, and the worker derives the slot from it, so a message
        # that waited in the queue still submits its own slot and no other.
        name = tuple(args)[0]
        return super().apply_async((name, time.time()), None, **options)


def beat_submit(self: BeatSubmitTask, *args: Any, **kwargs: Any) -> dict[str, str]:
    """Submit the job of the slot a tick names; refuse (log, submit nothing) a message
    that is not a tick of this app's schedule.

    A refusal raises Ignore: a task that returned would have Celery apply the chain and
    callbacks the message carries, and a forged tick could then create any job. Beat
    never sends a tick with any, so a tick that carries one is refused whole."""
    request = self.request
    try:
        if request.callbacks or request.errbacks or request.chain or request.chord:
            raise TickRefused("a tick carries no chain, callback or chord")
        if len(args) != 2 or kwargs or not isinstance(args[0], str):
            raise TickRefused("a tick carries exactly (entry name, tick time)")
        job, key = self.beat_jobs.submit_tick(args[0], args[1], time.time())
    except TickRefused as exc:
        log.warning("celery-lease: beat tick %.64r refused: %s; nothing submitted", request.id, exc)
        raise Ignore() from None
    return {"job": job.id, "key": key}


class BeatJobs:
    """The periodic leased jobs of one CeleryLease, and the task that submits them."""

    def __init__(
        self,
        app: Celery,
        registry: Registry,
        producer: Callable[[], Producer],
        keep_entry: Callable[[str, dict], None],
        resolve: Callable[[Any], JobKind] | None = None,
    ) -> None:
        self._app = app
        self._registry = registry
        #: Resolves a kind named before its module was imported (imports the app's task modules).
        self._resolve = resolve or registry.resolve
        self._producer = producer
        #: Keeps an entry in the beat schedule across later configuration (beat/entries.py).
        self._keep_entry = keep_entry
        self._entries: dict[str, Periodic] = {}
        #: Entries whose kind no handler declared yet: (kind name, schedule, payload).
        self._pending: dict[str, tuple[str, BaseSchedule, Any]] = {}
        app.task(
            name=BEAT_SUBMIT_TASK,
            base=BeatSubmitTask,
            bind=True,
            shared=False,
            _force_evaluate=True,
            beat_jobs=self,
        )(beat_submit)

        @signals.beat_init.connect(weak=False)
        def resolve_at_beat_start(sender=None, **_):
            if getattr(sender, "app", None) is app and self._pending:
                try:
                    self.resolve_pending()
                except Exception as exc:
                    # Raised, a signal handler's error is only logged, and beat would run
                    # without the entry: exit instead (SystemExit passes through signals).
                    log.critical("celery-lease: beat refuses to start: %s", exc)
                    raise SystemExit(f"celery-lease: beat refuses to start: {exc}") from None

        self._beat_handler = resolve_at_beat_start

    def add(self, name: str, task: Any, every: Any, payload: Any = None) -> Periodic | None:
        """The entry; None when ``task`` names a kind no handler declares yet (it is
        resolved when beat starts, see the module docstring)."""
        if not isinstance(name, str) or not name or len(name) > MAX_NAME_LENGTH:
            raise ValueError(f"a periodic job's name must be 1 to {MAX_NAME_LENGTH} characters")
        if name in self._entries or name in self._pending:
            raise ValueError(f"periodic job {name!r} is already scheduled")
        schedule_ = _as_schedule(every, self._app)
        payload = {} if payload is None else payload  # a job always has a payload
        try:
            spec = self._registry.resolve(task)
        except UnknownKind:
            if not isinstance(task, str):
                raise
            self._pending[name] = (task, schedule_, payload)
            entry = None
        else:
            # Validated with the codec alone: the producer reads the app's settings, and a
            # periodic job is usually declared at import, before the project configures the app.
            entry = self._entries[name] = Periodic(name, spec, schedule_, spec.codec.dump_payload(payload))
        self._keep_entry(name, {"task": BEAT_SUBMIT_TASK, "schedule": schedule_, "args": (name,)})
        return entry

    def resolve_pending(self, names: list[str] | None = None) -> None:
        """Resolve the kinds of entries declared before their handlers (``names``, or
        all); raises ConfigurationError naming the entries whose kind no handler declares."""
        unknown = []
        for name in list(self._pending) if names is None else [n for n in names if n in self._pending]:
            kind, schedule_, payload = self._pending[name]
            try:
                spec = self._resolve(kind)
            except UnknownKind:
                unknown.append(f"{name!r} (kind {kind!r})")
                continue
            self._entries[name] = Periodic(name, spec, schedule_, spec.codec.dump_payload(payload))
            del self._pending[name]
        if unknown:
            known = ", ".join(self._registry.names()) or "none"
            raise ConfigurationError(
                f"no job handler for periodic job {', '.join(unknown)} (registered: {known}); is the module "
                "that declares it imported by the app (include=, imports=, autodiscover_tasks())?"
            )

    def submit_tick(self, name: str, tick: Any, now: float) -> tuple[Job, str]:
        """Submit ``name``'s job for the slot of a tick stamped ``tick``; raises
        TickRefused (submitting nothing) for a tick beat could not have sent."""
        self.resolve_pending([name])  # a worker has imported its task modules by now
        entry = self._entries.get(name)
        if entry is None:
            raise TickRefused("no periodic job of that name in this process (beat and workers must run the same app)")
        key = entry.tick_key(tick, now)
        return self.submit(name, key), key

    def entry(self, name: str) -> Periodic:
        self.resolve_pending([name])
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
