"""The project's Celery app, as ``proj/celery.py`` in Celery's "First steps with Django",
with a periodic leased job when a test asks for one."""

from __future__ import annotations

import os

from celery import Celery

from celery_lease import CeleryLease

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.apps.djangoproj.settings")

app = Celery("djangoproj")
app.config_from_object("django.conf:settings", namespace="CELERY")
leases = CeleryLease(app)
app.autodiscover_tasks()

# A periodic job naming a kind that only the autodiscovered shop/tasks.py declares
# (CL_TEST_NIGHTLY: the kind), declared here at import or, as Celery's docs declare
# periodic tasks, in an on_after_finalize hook (CL_TEST_NIGHTLY_AT=finalize).
if os.environ.get("CL_TEST_NIGHTLY") and os.environ.get("CL_TEST_NIGHTLY_AT") != "finalize":
    leases.periodic("nightly", os.environ["CL_TEST_NIGHTLY"], 1.0, {"from": "beat"})


@app.on_after_finalize.connect
def schedule_nightly(sender, **_):
    if os.environ.get("CL_TEST_NIGHTLY") and os.environ.get("CL_TEST_NIGHTLY_AT") == "finalize":
        leases.periodic("nightly", os.environ["CL_TEST_NIGHTLY"], 1.0, {"from": "beat"})
