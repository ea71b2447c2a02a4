"""The Django project in tests/apps/djangoproj, driven as a Django web process would be
(a subprocess with DJANGO_SETTINGS_MODULE): settings through the CELERY_ namespace, and
submits inside transaction.atomic() written through Django's own connection."""

from __future__ import annotations

import subprocess
import sys

import sqlalchemy as sa

from celery_lease.db import migrate
from tests.conftest import ROOT, throwaway_database
from tests.harness.djangoproj import django_db_fixture, django_env, drive  # noqa: F401  (fixture)


def _manage(db: str, broker: str, *args: str, **extra: str) -> subprocess.CompletedProcess:
    env = {**django_env(db, broker), **extra}
    return subprocess.run([sys.executable, "-m", "django", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def _job_tables_revision(url: str) -> str | None:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            if not sa.inspect(conn).has_table(migrate.VERSION_TABLE):
                return None
            return conn.exec_driver_sql(f"SELECT version_num FROM {migrate.VERSION_TABLE}").scalar()
    finally:
        engine.dispose()


def test_submit_inside_atomic_joins_djangos_transaction(django_db, broker):
    seen = drive("atomic", django_db, broker)
    # CELERY_LEASE_SWEEP_STALE_SECONDS reached the lease settings.
    assert seen["settings"] == {"sweep_stale_seconds": 3.0}
    # Inside the block: written through Django's connection, so invisible to any other
    # connection, and no wakeup yet.
    assert seen["rollback_inside"] == {"row_elsewhere": False, "wakeups": 0}
    assert seen["rollback_after"] == {"row": False, "order": False, "wakeups": 0}
    assert seen["commit_inside"] == {"row_elsewhere": False, "wakeups": 0}
    # After COMMIT: both rows (the savepoint's too) and their wakeup: one for both, a
    # kind's wakeups being coalesced (waking.py) on a Redis broker.
    assert seen["commit_after"] == {"rows": ["pending", "pending"], "wakeups": 1}
    # Outside atomic(): committed at once; the wakeup already on its way takes it too.
    assert seen["autocommit"] == {"row": True, "wakeups": 1}


def test_manage_py_migrate_creates_the_job_tables_on_djangos_database(broker):
    with throwaway_database("celery_lease_django_migrate") as db:
        first = _manage(db, broker, "migrate", "--noinput")
        assert first.returncode == 0, first.stdout + first.stderr
        assert "Applying celery_lease.0001_job_tables... OK" in first.stdout
        assert _job_tables_revision(db) == migrate.head()
        # Idempotent: the Alembic upgrade again (the Django migration unapplied) changes nothing.
        again = _manage(db, broker, "migrate", "celery_lease", "zero", "--noinput")
        assert again.returncode == 0, again.stderr
        again = _manage(db, broker, "migrate", "--noinput")
        assert again.returncode == 0, again.stderr
        assert _job_tables_revision(db) == migrate.head()
        # A submit now works from the web process.
        seen = drive("atomic", db, broker)
        assert seen["autocommit"]["row"] is True


def test_manage_py_migrate_leaves_a_job_database_elsewhere_alone(broker):
    with throwaway_database("celery_lease_django_web") as web, throwaway_database("celery_lease_django_jobs") as jobs:
        proc = _manage(web, broker, "migrate", "--noinput", CL_TEST_JOB_DB=jobs)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        # Neither database got job tables: Django's is not the job database, and the job
        # database is not Django's to migrate; the warning says what to run.
        assert _job_tables_revision(web) is None and _job_tables_revision(jobs) is None
        assert "is not the database 'default' being migrated" in proc.stderr
        assert "celery -A proj lease migrate" in proc.stderr


def test_leased_jobs_under_djangos_test_runner_use_its_test_database(pg, broker):
    proc = _manage(pg, broker, "test", "tests.apps.djangoproj.shop.djangotests", "--noinput", "-v", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "Ran 3 tests" in proc.stderr and "OK" in proc.stderr
