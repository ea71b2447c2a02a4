"""Testing a Django project's leased jobs on Django's own test database.

The default test job database (a SQLite file per test) is not Django's, so a submit in
``transaction.atomic()`` does not join the test's transaction and ``ctx.effect`` cannot
reach the project's tables. :func:`job_database` (or a ``lease_database_url`` fixture
returning :func:`job_database_url`, docs/converting.md#tests) makes Django's test
database the job database. Tests must be transactional (``TransactionTestCase``,
``django_db(transaction=True)``): a plain ``TestCase`` runs in one transaction that the
worker's and the eager runner's own connections cannot see. PostgreSQL only: SQLite's
Django test database is in memory, per connection.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from django.db import connections

from celery_lease.db import migrate, urls
from celery_lease.db.store import Store
from celery_lease.extension import CeleryLease


def job_database_url(alias: str = "default") -> str:
    """A SQLAlchemy URL of Django's database ``alias`` as Django uses it now (under
    Django's test runner or pytest-django: the test database), with celery-lease's
    tables migrated there."""
    connection = connections[alias]
    url = urls.from_django(connection.settings_dict, connection.vendor, alias)
    store = Store(url)
    try:
        migrate.upgrade(store)  # idempotent: once per test database, then a no-op
    finally:
        store.dispose()
    return url


@contextmanager
def job_database(leases: CeleryLease, alias: str = "default") -> Iterator[str]:
    """``leases`` on Django's (test) database ``alias`` until exit; yields its URL."""
    from celery_lease.testing import switched

    url = job_database_url(alias)
    with switched(leases, url):
        yield url
