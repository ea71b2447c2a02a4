"""The Django app ``celery_lease.django``: wires the integration when Django starts (in
web processes, management commands, and Celery workers, whose Django fixup runs
``django.setup()`` before they take work)."""

from __future__ import annotations

from django.apps import AppConfig
from django.conf import settings


class CeleryLeaseConfig(AppConfig):
    name = "celery_lease.django"
    label = "celery_lease"
    verbose_name = "celery-lease"

    def ready(self) -> None:
        from celery_lease.django import transaction

        transaction.install()
        # Make the task backends now, so each registers its job kind on the Celery app
        # before a worker takes work (a kind unknown to a worker cannot be run).
        aliases = [alias for alias, conf in getattr(settings, "TASKS", {}).items() if _is_ours(conf.get("BACKEND", ""))]
        if aliases:
            from celery_lease.django.backend import task_backends

            for alias in aliases:
                task_backends[alias]


def _is_ours(path: str) -> bool:
    return path.startswith("celery_lease.django.")
