"""Index for a tenant's pages of jobs (the HTTP API's tenant-scoped list).

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    where = sa.text("tenant IS NOT NULL")
    op.create_index("celery_lease_jobs_tenant", "celery_lease_jobs", ["tenant", "created_at", "id"],
                    postgresql_where=where, sqlite_where=where)


def downgrade() -> None:
    op.drop_index("celery_lease_jobs_tenant", table_name="celery_lease_jobs")
