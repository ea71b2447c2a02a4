"""Index for a tenant's pages of jobs (the HTTP API's tenant-scoped list).

Revision ID: 0003
Revises: 0002_canvas
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002_canvas"
branch_labels = None
depends_on = None


def upgrade() -> None:
    where = sa.text("tenant IS NOT NULL")
    op.create_index("celery_lease_jobs_tenant", "celery_lease_jobs", ["tenant", "created_at", "id"],
                    postgresql_where=where, sqlite_where=where)


def downgrade() -> None:
    op.drop_index("celery_lease_jobs_tenant", table_name="celery_lease_jobs")
