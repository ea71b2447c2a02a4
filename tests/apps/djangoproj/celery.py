"""The project's Celery app, as ``proj/celery.py`` in Celery's "First steps with Django"."""

from __future__ import annotations

import os

from celery import Celery

from celery_lease import CeleryLease

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.apps.djangoproj.settings")

app = Celery("djangoproj")
app.config_from_object("django.conf:settings", namespace="CELERY")
leases = CeleryLease(app)
app.autodiscover_tasks()
