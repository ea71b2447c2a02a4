"""The maintenance tasks (reap, sweep, prune) and their beat entries.

The entries are written into ``app.conf.beat_schedule`` each time the app's
configuration is loaded (``on_after_configure``), so a later
``app.config_from_object(...)`` keeps them, and again when beat starts (``beat_init``,
before its scheduler reads the schedule): an entry missing there (e.g. replaced by an
``app.conf.beat_schedule = {...}`` assignment) is put back with a warning that names
it. Without them nothing reaps, retries or delivers delayed jobs; pass
``install_beat=False`` to ``CeleryLease`` to schedule maintenance yourself.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from celery import Celery, signals

from celery_lease.beat.maintenance import Maintenance
from celery_lease.beat.runner import TickRunner
from celery_lease.settings import Settings

log = logging.getLogger("celery_lease.maintenance")

REAP_TASK = "celery_lease.reap"
SWEEP_TASK = "celery_lease.sweep"
PRUNE_TASK = "celery_lease.prune"


def _intervals(settings: Settings) -> dict[str, float]:
    return {
        REAP_TASK: float(settings.reap_interval),
        SWEEP_TASK: float(settings.sweep_interval),
        PRUNE_TASK: float(settings.prune_interval),
    }


def _entries(settings: Settings) -> dict[str, dict]:
    # Own queue, consumed by a thread of each worker's main process (beat/runner.py),
    # never by the pool: behind prefetched job messages a tick would wait while
    # reaping is most needed. No "expires": it would be an absolute time from beat's
    # clock, judged by the worker's; a backlog is skipped by the runner instead.
    options = {"queue": settings.maintenance_queue}
    return {name: {"task": name, "schedule": interval, "options": options} for name, interval in _intervals(settings).items()}


def register(
    app: Celery, maintenance: Callable[[], Maintenance], settings: Callable[[], Settings], *, install_beat: bool
) -> None:
    """Register the maintenance tasks and, unless disabled, keep their beat entries."""

    def reap_task():
        return maintenance().reap()

    def sweep_task():
        return maintenance().sweep()

    def prune_task():
        return maintenance().prune()

    fns = {REAP_TASK: reap_task, SWEEP_TASK: sweep_task, PRUNE_TASK: prune_task}
    for name, fn in fns.items():
        # Still tasks: a tick sent by hand (or that reaches a pool) runs there too.
        app.task(name=name, shared=False, ignore_result=True, _force_evaluate=True)(fn)

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
        runner = runners.setdefault(os.getpid(), TickRunner(app, settings().maintenance_queue, tasks))
        runner.start()

    @signals.worker_shutdown.connect(weak=False)
    def stop_ticks(sender=None, **_):
        runner = runners.pop(os.getpid(), None)
        if runner is not None:
            runner.stop()

    if not install_beat:
        return

    def install(warn: bool) -> None:
        schedule = dict(app.conf.beat_schedule or {})
        missing = [name for name in _entries(settings()) if name not in schedule]
        if not missing:
            return
        if warn:
            log.warning(
                "celery-lease: the beat schedule has no %s entry (replaced by a later "
                "beat_schedule setting?); installing it. Without it nothing reaps, retries or "
                "delivers delayed jobs",
                ", ".join(missing),
            )
        entries = _entries(settings())
        app.conf.beat_schedule = {**schedule, **{name: entries[name] for name in missing}}

    @app.on_after_configure.connect(weak=False)
    def on_configure(sender=None, **_):
        install(warn=False)

    @signals.beat_init.connect(weak=False)
    def on_beat_start(sender=None, **_):
        if getattr(sender, "app", None) is app:
            install(warn=True)

    if app.configured:
        install(warn=False)
    app._celery_lease_beat_handlers = (keep_ticks_out_of_the_pool, run_ticks, stop_ticks, on_configure, on_beat_start)
