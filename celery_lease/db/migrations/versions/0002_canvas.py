"""Celery canvas on leased jobs: each job's remaining canvas, and chord counters.

Revision ID: 0002_canvas
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0002_canvas"
down_revision = "0001"
branch_labels = None
depends_on = None

JSON = sa.JSON(none_as_null=True).with_variant(postgresql.JSONB(none_as_null=True), "postgresql")
TS = sa.DateTime(timezone=True)
ID = sa.Uuid(as_uuid=False)


def upgrade() -> None:
    with op.batch_alter_table("celery_lease_jobs") as batch:
        batch.add_column(sa.Column("canvas", JSON))
    op.create_table(
        "celery_lease_chords",
        sa.Column("id", ID, primary_key=True),
        sa.Column("remaining", sa.Integer, nullable=False),
        sa.Column("members", JSON, nullable=False),
        sa.Column("body", JSON, nullable=False),
        sa.Column("created_at", TS, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("celery_lease_chords")
    with op.batch_alter_table("celery_lease_jobs") as batch:
        batch.drop_column("canvas")
