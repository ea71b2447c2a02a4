"""Django integration: leased jobs in a Django project.

In ``settings.py``::

    INSTALLED_APPS = [..., "celery_lease.django"]
    TASKS = {"default": {"BACKEND": "celery_lease.django.LeaseTaskBackend"}}   # django.tasks

With the app installed:

* a submit made while one of Django's connections to the job database is inside
  ``transaction.atomic()`` is written in that transaction, through that connection, and
  its wakeup is published by ``transaction.on_commit``: a rollback leaves no job and no
  wakeup (:mod:`celery_lease.django.transaction`);
* ``manage.py migrate`` creates and upgrades the job tables when the job database is
  Django's (:mod:`celery_lease.django.schema`);
* tests can use Django's test database as the job database
  (:mod:`celery_lease.django.testing`);
* ``django.tasks`` (Django >= 6.0, or the ``django-tasks`` backport) enqueue durable
  leased jobs through :class:`~celery_lease.django.backend.LeaseTaskBackend`, run by the
  project's Celery workers.

The Celery app comes from the project as usual (``proj/celery.py`` with
``app.config_from_object("django.conf:settings", namespace="CELERY")`` and
``CeleryLease(app)``); every ``CELERY_LEASE_*`` setting is read from there.
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
