"""Fair share across tenants (celery-lease's migration 0015_fair_share)."""

from django.db import migrations

from celery_lease.django.schema import upgrade_job_tables

ALEMBIC_HEAD = "0015_fair_share"


class Migration(migrations.Migration):
    # Alembic runs on a connection of its own, in its own transaction.
    atomic = False
    dependencies = [("celery_lease", "0001_job_tables")]
    operations = [migrations.RunPython(upgrade_job_tables, migrations.RunPython.noop, elidable=False)]
