"""Runtime limits: an operator's override of a kind's concurrency and rate, stored
beside the limits its workers declare (celery_lease_limits), read by every claim.

NULL keeps the declared value (the code default), 0 is explicitly no limit, N >= 1 the
limit; per_seconds_override goes with rate_override N. Adding nullable columns rewrites
nothing.

Revision ID: 0013_kind_limits
Revises: 0012_attempts
"""

import sqlalchemy as sa
from alembic import op

revision = "0013_kind_limits"
down_revision = "0012_attempts"
branch_labels = None
depends_on = None

COLUMNS = ("concurrency_override", "rate_override", "per_seconds_override")


def upgrade() -> None:
    for name in COLUMNS:
        op.add_column("celery_lease_limits", sa.Column(name, sa.Integer))


def downgrade() -> None:
    with op.batch_alter_table("celery_lease_limits") as batch:
        for name in reversed(COLUMNS):
            batch.drop_column(name)
