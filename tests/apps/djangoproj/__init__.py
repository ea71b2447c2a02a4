"""A Django project laid out as Django and Celery document it, for the Django tests:
``settings.py`` (every Celery and celery-lease setting ``CELERY_``-prefixed),
``celery.py`` (``config_from_object("django.conf:settings", namespace="CELERY")``,
``CeleryLease(app)``, ``autodiscover_tasks()``) and the app ``shop`` whose ``tasks.py``
holds leased jobs (``celery_lease.shared_job``) and ``django.tasks`` tasks.

Environment: CL_TEST_DB (a SQLAlchemy PostgreSQL URL, used by Django and by the job
table alike, unless CL_TEST_JOB_DB names another for the job table), CL_TEST_BROKER,
and DJANGO_SETTINGS_MODULE=tests.apps.djangoproj.settings.
"""

from tests.apps.djangoproj.celery import app as celery_app

__all__ = ("celery_app",)
