"""The submitter's trace context in the job row (celery_lease.tracing).

Every attempt's span is a child of the submit's context, also after retries, reaps and
re-sent wakeups: the row carries it, not the wakeup. Nullable, no default: adding it
rewrites nothing, and an untraced job stores NULL.

Revision ID: 0006_trace_context
Revises: 0005_sweep_index
"""

import sqlalchemy as sa
from alembic import op

revision = "0006_trace_context"
down_revision = "0005_sweep_index"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("celery_lease_jobs", sa.Column("trace_context", sa.Text()))


def downgrade() -> None:
    op.drop_column("celery_lease_jobs", "trace_context")
