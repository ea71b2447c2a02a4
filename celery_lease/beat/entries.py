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
from collections.abc import Callable

from celery import Celery, signals

from celery_lease.beat.maintenance import Maintenance
from celery_lease.settings import Settings

log = logging.getLogger("celery_lease.maintenance")

REAP_TASK = "celery_lease.reap"
SWEEP_TASK = "celery_lease.sweep"
PRUNE_TASK = "celery_lease.prune"


def _entries(settings: Settings) -> dict[str, dict]:
    # Own queue: behind a backlog of wakeups on the default queue, a tick would wait
    # (and expire) while reaping is most needed. expires: a tick that waited longer
    # than its interval (workers down) is dropped, not piled up.
    out = {}
    for name, interval in (
        (REAP_TASK, settings.reap_interval),
        (SWEEP_TASK, settings.sweep_interval),
        (PRUNE_TASK, settings.prune_interval),
    ):
        options = {"expires": float(interval), "queue": settings.maintenance_queue}
        out[name] = {"task": name, "schedule": float(interval), "options": options}
    return out


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

    for name, fn in ((REAP_TASK, reap_task), (SWEEP_TASK, sweep_task), (PRUNE_TASK, prune_task)):
        app.task(name=name, shared=False, ignore_result=True, _force_evaluate=True)(fn)

    @signals.celeryd_after_setup.connect(weak=False)
    def consume_maintenance_queue(sender=None, instance=None, **_):
        # Every worker of this app also consumes the maintenance queue, whatever -Q says.
        if instance is not None and instance.app is app:
            instance.app.amqp.queues.select_add(settings().maintenance_queue)

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
    app._celery_lease_beat_handlers = (consume_maintenance_queue, on_configure, on_beat_start)
