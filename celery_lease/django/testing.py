"""Testing a Django project's leased jobs on Django's own test database.

The default test job database (``celery_lease.testing``: a SQLite file per test) is not
Django's, so a submit inside ``transaction.atomic()`` does not join the test's
transaction (a rollback test fails falsely) and ``ctx.effect`` cannot reach the
project's tables. :func:`job_database` makes Django's test database the job database:

* ``with job_database(leases): ...`` in a test, or, with pytest, ``lease_database_url``
  overridden by a fixture that returns ``job_database_url()`` (docs/converting.md#tests);
* with a *transactional* test (``TransactionTestCase``, pytest-django's
  ``django_db(transaction=True)``): a plain ``TestCase`` / ``django_db`` runs each test
  inside one transaction that no other connection sees, and the worker and the eager
  runner read jobs on their own connections.

PostgreSQL only: SQLite's Django test database is in memory, per connection.
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
