"""Flow control: job priority, concurrency key and hold reason; limits and pauses.

Revision ID: 0004_flow
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004_flow"
down_revision = "0003"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def _partial(where: str) -> dict:
    return {"postgresql_where": sa.text(where), "sqlite_where": sa.text(where)}


def upgrade() -> None:
    op.add_column("celery_lease_jobs", sa.Column("priority", sa.Integer, nullable=False, server_default="0"))
    op.add_column("celery_lease_jobs", sa.Column("concurrency_key", sa.String(255)))
    op.add_column("celery_lease_jobs", sa.Column("held", sa.String(16)))
    op.create_index("celery_lease_jobs_held", "celery_lease_jobs", ["kind", "concurrency_key", "priority", "created_at"],
                    **_partial("status = 'pending' AND held IS NOT NULL"))
    op.create_index("celery_lease_jobs_priority", "celery_lease_jobs", ["kind", "priority", "created_at"],
                    **_partial("status = 'pending' AND priority > 0"))
    op.create_table(
        "celery_lease_limits",
        sa.Column("kind", sa.String(200), primary_key=True),
        sa.Column("concurrency", sa.Integer),
        sa.Column("rate", sa.Integer),
        sa.Column("per_seconds", sa.Integer),
        sa.Column("rate_window", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("rate_claims", sa.Integer, nullable=False, server_default="0"),
        sa.Column("woken_window", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("updated_at", TS, nullable=False),
    )
    op.create_table(
        "celery_lease_pauses",
        sa.Column("kind", sa.String(200), primary_key=True),
        sa.Column("paused_at", TS, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("celery_lease_pauses")
    op.drop_table("celery_lease_limits")
    op.drop_index("celery_lease_jobs_priority", "celery_lease_jobs")
    op.drop_index("celery_lease_jobs_held", "celery_lease_jobs")
    with op.batch_alter_table("celery_lease_jobs") as batch:
        batch.drop_column("held")
        batch.drop_column("concurrency_key")
        batch.drop_column("priority")
