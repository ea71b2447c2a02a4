"""The attempt log of every job (celery_lease_jobs.attempts): which worker ran each
attempt, when, and how it ended, kept on the job row and written by the statements
that claim and end attempts (db/statements/attempt_log.py). Jobs created before it
have no log (NULL) until their next claim.

Revision ID: 0012_attempts
Revises: 0011_landing_outbox
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0012_attempts"
down_revision = "0011_landing_outbox"
branch_labels = None
depends_on = None


def upgrade() -> None:
    json = sa.JSON(none_as_null=True).with_variant(postgresql.JSONB(none_as_null=True), "postgresql")
    # A nullable column without a default: no table rewrite on PostgreSQL.
    op.add_column("celery_lease_jobs", sa.Column("attempts", json))


def downgrade() -> None:
    op.drop_column("celery_lease_jobs", "attempts")
