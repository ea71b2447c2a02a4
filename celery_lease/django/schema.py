"""``manage.py migrate`` creates and upgrades celery-lease's job tables.

The app's Django migration runs celery-lease's own migrations (Alembic, versioned in
``celery_lease_alembic_version``, so running them again changes nothing) when the job
database is the database Django is migrating, as the server itself tells (see
:mod:`celery_lease.django.transaction`). On any other database (the job tables live on
another server or in SQLite, ``migrate --database other``, or Django's test database
while the job database stays the configured one) it leaves them alone and warns: those
tables are migrated by ``celery -A proj lease migrate``.
"""

from __future__ import annotations

import logging
from typing import Any

from celery_lease.extension import CeleryLease

log = logging.getLogger("celery_lease")


def upgrade_job_tables(apps: Any, schema_editor: Any) -> None:
    """The RunPython operation of the app's migrations."""
    from celery_lease.django import transaction

    connection = schema_editor.connection
    leases = _project_leases()
    if leases is None:
        log.warning(
            "celery-lease: no Celery app with a CeleryLease is loaded (import it in the project's __init__.py, as "
            "Celery's Django layout does); the job tables were not migrated: run celery -A proj lease migrate"
        )
        return
    store = leases.store
    if connection.vendor != store.capabilities.joinable_vendor or transaction.identity_of(
        connection
    ) != transaction.store_identity(store):
        log.warning(
            "celery-lease: the job database (%s) is not the database %r being migrated; its tables were not "
            "migrated here: run celery -A proj lease migrate",
            store.display_url,
            connection.alias,
        )
        return
    revision = leases.create_schema()
    log.info("celery-lease: job tables at revision %s", revision)


def _project_leases() -> CeleryLease | None:
    from celery import current_app

    leases = getattr(current_app._get_current_object(), "lease", None)
    return leases if isinstance(leases, CeleryLease) else None
