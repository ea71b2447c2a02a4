"""Lists of failed, expired or cancelled jobs read an index: celery_lease_jobs_unsuccessful.

``GET /api/v1/jobs?status=failed`` walked celery_lease_jobs_created newest first and
filtered: with few failures among 300k jobs that is nearly the whole table, for any
tenant token, on every request (issue 19). The index holds only jobs that ended
without success, so a submit, a claim or a success pays nothing for it.

Revision ID: 0007_unsuccessful_index
Revises: 0006_trace_context
"""

import sqlalchemy as sa
from alembic import op

revision = "0007_unsuccessful_index"
down_revision = "0006_trace_context"
branch_labels = None
depends_on = None

WHERE = "status IN ('cancelled', 'expired', 'failed')"


def upgrade() -> None:
    op.create_index("celery_lease_jobs_unsuccessful", "celery_lease_jobs", ["status", "created_at", "id"],
                    postgresql_where=sa.text(WHERE), sqlite_where=sa.text(WHERE))


def downgrade() -> None:
    op.drop_index("celery_lease_jobs_unsuccessful", table_name="celery_lease_jobs")
