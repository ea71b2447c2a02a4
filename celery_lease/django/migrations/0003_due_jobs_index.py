"""The due jobs' index of the claim of many jobs (celery-lease's migration 0016_due_jobs_index)."""

from django.db import migrations

from celery_lease.django.schema import upgrade_job_tables

ALEMBIC_HEAD = "0016_due_jobs_index"


class Migration(migrations.Migration):
    # Alembic runs on a connection of its own, in its own transaction.
    atomic = False
    dependencies = [("celery_lease", "0002_fair_share")]
    operations = [migrations.RunPython(upgrade_job_tables, migrations.RunPython.noop, elidable=False)]
