"""The tests' app with the flow-control kinds (app_flow) and a batched kind (app_batch),
for workers that reach PostgreSQL through PgBouncer (tests/e2e/test_pgbouncer.py)."""

from __future__ import annotations

from tests.apps.app import app, echo, leases, steps  # noqa: F401  (app: celery -A finds it here)
from tests.apps.app_batch import b_note  # noqa: F401
from tests.apps.app_flow import chaos_limited, limited2, rated  # noqa: F401
