"""tests.apps.app with Celery's message signing: ``task_serializer = "auth"``, accepting
only signed messages, with the key and certificates in CL_TEST_SIGNING_DIR (made by
tests/e2e/test_worker_security.py)."""

from __future__ import annotations

import os

from tests.apps.app import app, echo, leases, parent  # noqa: F401  (the tasks the tests use)

_DIR = os.environ["CL_TEST_SIGNING_DIR"]
app.conf.update(
    task_serializer="auth",
    accept_content=["auth"],
    security_key=os.path.join(_DIR, "key.pem"),
    security_certificate=os.path.join(_DIR, "cert.pem"),
    security_cert_store=os.path.join(_DIR, "store", "*.pem"),
)
app.setup_security()
