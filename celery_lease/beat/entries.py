"""The maintenance tasks (reap, sweep, prune) and the beat entries celery-lease keeps.

Two kinds of entries live in ``app.conf.beat_schedule``: the maintenance ticks (unless
``CeleryLease(app, install_beat=False)``) and the periodic leased jobs of
``leases.periodic(...)``. Projects configure the app after creating it, which replaces
the schedule, so the entries are kept, not written once: put back silently each time
the configuration loads (``on_after_configure``), and added to beat's own scheduler,
with a warning naming them, when beat starts (``beat_init``) without them (an
``app.conf.beat_schedule = {...}`` assignment fires no signal). Celery's per-task INFO
lines (and beat's "Sending due task") are lowered to DEBUG for the maintenance tasks.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from celery import Celery, signals

from celery_lease.beat.maintenance import Maintenance
from celery_lease.beat.runner import TickRunner
from celery_lease.settings import Settings

log = logging.getLogger("celery_lease.maintenance")

REAP_TASK = "celery_lease.reap"
SWEEP_TASK = "celery_lease.sweep"
PRUNE_TASK = "celery_lease.prune"
ARCHIVE_TASK = "celery_lease.archive"
MAINTENANCE_TASKS = frozenset({REAP_TASK, SWEEP_TASK, PRUNE_TASK, ARCHIVE_TASK})

#: Celery's loggers that write one INFO line per task or tick.
_TICK_LOGGERS = ("celery.worker.strategy", "celery.app.trace", "celery.beat")


def _intervals(settings: Settings) -> dict[str, float]:
    return {
        REAP_TASK: float(settings.reap_interval),
        SWEEP_TASK: float(settings.sweep_interval),
        PRUNE_TASK: float(settings.prune_interval),
        ARCHIVE_TASK: float(settings.archive_interval),
    }


def _entries(settings: Settings) -> dict[str, dict]:
    # Own queue, consumed by a thread of each worker's main process (beat/runner.py),
    # never by the pool: behind prefetched job messages a tick would wait while
    # reaping is most needed. No "expires": it would be an absolute time from beat's
    # clock, judged by the worker's; a backlog is skipped by the runner instead.
    options = {"queue": settings.maintenance_queue}
    return {name: {"task": name, "schedule": interval, "options": options} for name, interval in _intervals(settings).items()}


class QuietTicks(logging.Filter):
    """Lowers Celery's per-task INFO lines about the maintenance tasks to DEBUG: dropped
    unless the logger is set to DEBUG (``-l DEBUG``), then shown as DEBUG lines."""

    def filter(self, record: logging.LogRecord) -> bool:
        args: Any = record.args
        if isinstance(args, dict):
            names = {args.get("name")}
        elif isinstance(args, tuple):
            # (Not set(args): beat's "Message Error" line, logged when the broker is down,
            # carries a list; a filter that raises takes beat down with it.)
            names = {a for a in args if isinstance(a, str)}
        else:
            return True
        if record.levelno == logging.INFO and names & MAINTENANCE_TASKS:
            # Handlers usually have no level of their own (Celery's have none), so
            # the logger's level decides, as it would have for a DEBUG call.
            if logging.getLogger(record.name).getEffectiveLevel() > logging.DEBUG:
                return False
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


_QUIET = QuietTicks()


def quiet_maintenance_logs() -> None:
    """Install the filter on Celery's task loggers (idempotent, process-wide)."""
    for name in _TICK_LOGGERS:
        logger = logging.getLogger(name)
        if _QUIET not in logger.filters:
            logger.addFilter(_QUIET)


class BeatSchedule:
    """The entries celery-lease keeps in the beat schedule of one app."""

    def __init__(self, app: Celery, settings: Callable[[], Settings], *, maintenance: bool) -> None:
        self._app = app
        self._settings = settings
        self._maintenance = maintenance
        self._periodic: dict[str, dict] = {}

    def wanted(self) -> dict[str, dict]:
        out = _entries(self._settings()) if self._maintenance else {}
        out.update(self._periodic)
        return out

    def add(self, name: str, entry: dict) -> None:
        """Keep ``entry`` (a periodic leased job) in the schedule from now on."""
        self._periodic[name] = entry
        # Before the app is configured, on_after_configure installs it; reading
        # app.conf here would configure the app before the project does.
        if self._app.configured:
            self.install(warn=False)

    def install(self, *, warn: bool, scheduler: Any = None) -> list[str]:
        """Put missing entries back into ``app.conf.beat_schedule`` and, when beat has
        started, into its ``scheduler``; returns the names that were missing."""
        wanted = self.wanted()
        schedule = dict(self._app.conf.beat_schedule or {})
        missing = [name for name in wanted if name not in schedule]
        if missing:
            self._app.conf.beat_schedule = {**schedule, **{name: wanted[name] for name in missing}}
        if scheduler is not None:
            # The scheduler read the schedule before beat_init: add to it directly
            # (update_from_dict only adds; custom schedulers such as
            # django-celery-beat's store what it is given).
            absent = [name for name in wanted if name not in scheduler.schedule]
            if absent:
                scheduler.update_from_dict({name: wanted[name] for name in absent})
            missing = sorted(set(missing) | set(absent))
        if warn and missing:
            log.warning(
                "celery-lease: the beat schedule had no %s entry (replaced by a later beat_schedule "
                "setting?); added it to this beat. Without the maintenance entries nothing reaps, "
                "retries or delivers delayed jobs",
                ", ".join(missing),
            )
        return missing


def register(
    app: Celery, maintenance: Callable[[], Maintenance], settings: Callable[[], Settings], *, install_beat: bool
) -> BeatSchedule:
    """Register the maintenance tasks and keep celery-lease's beat entries."""

    def reap_task():
        return maintenance().reap()

    def sweep_task():
        return maintenance().sweep()

    def prune_task():
        return maintenance().prune()

    def archive_task():
        return maintenance().archive()

    fns = {REAP_TASK: reap_task, SWEEP_TASK: sweep_task, PRUNE_TASK: prune_task, ARCHIVE_TASK: archive_task}
    for name, fn in fns.items():
        # Still tasks: a tick sent by hand (or that reaches a pool) runs there too.
        app.task(name=name, shared=False, ignore_result=True, _force_evaluate=True)(fn)
    quiet_maintenance_logs()

    runners: dict[int, TickRunner] = {}

    @signals.celeryd_after_setup.connect(weak=False)
    def keep_ticks_out_of_the_pool(sender=None, instance=None, **_):
        # The pool's consumer leaves the maintenance queue to the TickRunner, even when
        # -Q names it (as deployments did before), unless it is the only queue.
        if instance is not None and instance.app is app:
            queues = instance.app.amqp.queues
            name = settings().maintenance_queue
            if set(queues.consume_from) - {name}:
                queues.deselect(name)

    @signals.worker_ready.connect(weak=False)
    def run_ticks(sender=None, **_):
        # The main process, after restart recovery and after the pool forked.
        if getattr(sender, "app", None) is not app:
            return
        tasks = {name: (fns[name], interval) for name, interval in _intervals(settings()).items()}
        hostname = getattr(sender, "hostname", None)
        runner = runners.setdefault(os.getpid(), TickRunner(app, settings().maintenance_queue, tasks, hostname))
        runner.start()

    @signals.worker_shutdown.connect(weak=False)
    def stop_ticks(sender=None, **_):
        runner = runners.pop(os.getpid(), None)
        if runner is not None:
            runner.stop()

    schedule = BeatSchedule(app, settings, maintenance=install_beat)

    @app.on_after_configure.connect(weak=False)
    def on_configure(sender=None, **_):
        schedule.install(warn=False)

    @signals.beat_init.connect(weak=False)
    def on_beat_start(sender=None, **_):
        if getattr(sender, "app", None) is app:
            schedule.install(warn=True, scheduler=sender.scheduler)

    if app.configured:
        schedule.install(warn=False)
    app._celery_lease_beat_handlers = (keep_ticks_out_of_the_pool, run_ticks, stop_ticks, on_configure, on_beat_start)
    return schedule
