"""Dashboard sessions in the database, so signing out ends a session in every serve
process, and a session survives a restart only while its row does.

Revision ID: 0009_sessions
Revises: 0008_jobs_fillfactor
"""

import sqlalchemy as sa
from alembic import op

revision = "0009_sessions"
down_revision = "0008_jobs_fillfactor"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "celery_lease_sessions",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("token", sa.String(64), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("expires_at", TS, nullable=False),
    )
    op.create_index("celery_lease_sessions_expires", "celery_lease_sessions", ["expires_at"])


def downgrade() -> None:
    op.drop_index("celery_lease_sessions_expires", "celery_lease_sessions")
    op.drop_table("celery_lease_sessions")
