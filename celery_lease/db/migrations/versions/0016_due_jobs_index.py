"""The claim of many jobs walks an index of the due jobs of one kind and queue in claim
order (celery_lease_jobs_due): every kind with no limit in its code claims that way on
PostgreSQL since this release, and without it each claim sorted every pending job of
its kind. Building it reads celery_lease_jobs once; writes to it wait meanwhile.

Revision ID: 0016_due_jobs_index
Revises: 0015_fair_share
"""

import sqlalchemy as sa
from alembic import op

revision = "0016_due_jobs_index"
down_revision = "0015_fair_share"
branch_labels = None
depends_on = None

PENDING = "status = 'pending' AND held IS NULL"


def upgrade() -> None:
    op.create_index(
        "celery_lease_jobs_due",
        "celery_lease_jobs",
        ["kind", sa.text("coalesce(queue, '')"), sa.text("priority DESC"), "fair_key", "created_at"],
        postgresql_where=sa.text(PENDING),
        sqlite_where=sa.text(PENDING),
    )


def downgrade() -> None:
    op.drop_index("celery_lease_jobs_due", "celery_lease_jobs")
