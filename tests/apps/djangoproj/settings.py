"""Settings of the test Django project (see the package docstring)."""

from __future__ import annotations

import os
import sys

from sqlalchemy.engine import make_url

_db = make_url(os.environ["CL_TEST_DB"])

SECRET_KEY = "celery-lease-tests-only"
DEBUG = False
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _db.database,
        "USER": _db.username or "",
        "PASSWORD": _db.password or "",
        "HOST": _db.host or "",
        "PORT": str(_db.port or ""),
    }
}
INSTALLED_APPS = [
    *(["django_tasks"] if sys.version_info < (3, 12) else []),  # django.tasks' backport before Django 6
    "celery_lease.django",
    "tests.apps.djangoproj.shop",
]
TASKS = {
    "default": {
        "BACKEND": "celery_lease.django.LeaseTaskBackend",
        "QUEUES": ["default", "held"],
        "OPTIONS": {"MAX_ATTEMPTS": 2, "LEASE_SECONDS": 5},
    }
}

CELERY_BROKER_URL = os.environ.get("CL_TEST_BROKER", "memory://")
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_LEASE_DATABASE_URL = os.environ.get("CL_TEST_JOB_DB") or os.environ["CL_TEST_DB"]  # the same database unless a test says
CELERY_LEASE_REAP_INTERVAL = 1.0
CELERY_LEASE_SWEEP_INTERVAL = 0.5
CELERY_LEASE_SWEEP_STALE_SECONDS = 3.0
