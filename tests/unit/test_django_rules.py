"""The Django app's rules that need no project: its migrations keep up with the job tables' Alembic head."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_latest_django_migration_brings_the_shipped_job_tables():
    # A release that adds an Alembic revision adds a Django migration too, or
    # `manage.py migrate` would never upgrade the job tables of a Django project.
    from celery_lease.db import migrate

    folder = ROOT / "celery_lease" / "django" / "migrations"
    latest = max(path for path in folder.glob("0*.py"))
    assert f'ALEMBIC_HEAD = "{migrate.head()}"' in latest.read_text(), latest.name
