"""The claim token: re-runs of a claim adopt by identity.

A claim whose reply was lost (a dropped connection, a server restart) is retried; the
retry, and the adoption that settles it, must find exactly the rows the first try took.
Before, adoption took any running row of the kind under the claim's owner, which was
also a job this process had finished but not yet recorded (issue #27, item 4), and a
batched claim re-run after a restart claimed other rows (item 2). Each claim now writes
a random ``claim_token`` (the same for its retries) and adoption matches it. Not
indexed: it is read only to settle a lost reply, among the running rows of one owner.

Revision ID: 0010_claim_token
Revises: 0009_sessions
"""

import sqlalchemy as sa
from alembic import op

revision = "0010_claim_token"
down_revision = "0009_sessions"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("celery_lease_jobs", sa.Column("claim_token", sa.BigInteger))


def downgrade() -> None:
    with op.batch_alter_table("celery_lease_jobs") as batch:
        batch.drop_column("claim_token")
