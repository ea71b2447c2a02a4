"""The job tables, made by celery-lease's own migrations (celery_lease.django.schema).

Each celery-lease release whose job tables change adds a migration here that runs the
same operation, so ``manage.py migrate`` upgrades them too; ``ALEMBIC_HEAD`` names the
revision the latest one brings (a unit test keeps it equal to the shipped head).
"""

from django.db import migrations

from celery_lease.django.schema import upgrade_job_tables

ALEMBIC_HEAD = "0014_history"


class Migration(migrations.Migration):
    # Alembic runs on a connection of its own, in its own transaction.
    atomic = False
    initial = True
    dependencies: list = []
    operations = [migrations.RunPython(upgrade_job_tables, migrations.RunPython.noop, elidable=False)]
