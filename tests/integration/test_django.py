"""The Django project in tests/apps/djangoproj, driven as a Django web process would be
(a subprocess with DJANGO_SETTINGS_MODULE): settings through the CELERY_ namespace, and
submits inside transaction.atomic() written through Django's own connection."""

from __future__ import annotations

from tests.harness.djangoproj import django_db_fixture, drive  # noqa: F401  (fixture)


def test_submit_inside_atomic_joins_djangos_transaction(django_db, broker):
    seen = drive("atomic", django_db, broker)
    # CELERY_LEASE_SWEEP_STALE_SECONDS reached the lease settings.
    assert seen["settings"] == {"sweep_stale_seconds": 3.0}
    # Inside the block: written through Django's connection, so invisible to any other
    # connection, and no wakeup yet.
    assert seen["rollback_inside"] == {"row_elsewhere": False, "wakeups": 0}
    assert seen["rollback_after"] == {"row": False, "order": False, "wakeups": 0}
    assert seen["commit_inside"] == {"row_elsewhere": False, "wakeups": 0}
    # After COMMIT: both rows (the savepoint's too) and one wakeup each.
    assert seen["commit_after"] == {"rows": ["pending", "pending"], "wakeups": 2}
    assert seen["autocommit"] == {"row": True, "wakeups": 3}
