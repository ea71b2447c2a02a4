"""Django integration: leased jobs in a Django project.

With ``"celery_lease.django"`` in ``INSTALLED_APPS``: a submit inside
``transaction.atomic()`` on the job database is written in that transaction and its
wakeup published on commit (:mod:`celery_lease.django.transaction`); ``manage.py
migrate`` creates and upgrades the job tables when the job database is Django's
(:mod:`celery_lease.django.schema`); tests can use Django's test database
(:mod:`celery_lease.django.testing`); and with ``TASKS = {"default": {"BACKEND":
"celery_lease.django.LeaseTaskBackend"}}`` ``django.tasks`` enqueue leased jobs
(:mod:`celery_lease.django.backend`). The Celery app comes from the project as usual
(``proj/celery.py``, ``CeleryLease(app)``); every ``CELERY_LEASE_*`` setting is read there.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    # Imported on first use: the backend needs Django's tasks framework, the rest of this
    # package only Django.
    if name == "LeaseTaskBackend":
        from celery_lease.django.backend import LeaseTaskBackend

        return LeaseTaskBackend
    raise AttributeError(name)
