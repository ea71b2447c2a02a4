"""A Landing's marker rows and the outbox of follow-ups that leave the database.

celery_lease_landings: each transaction of a Landing inserts a row under a token its
client made, so a lost reply is settled by whether the row exists, never by asking the
server about a transaction id (which a crash of one backend can make name another
transaction). celery_lease_outbox: a plain Celery callback or errback is written in the
transaction that sets it off and sent from there, by the worker or by the sweeper.

Revision ID: 0011_landing_outbox
Revises: 0010_claim_token
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0011_landing_outbox"
down_revision = "0010_claim_token"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)
ID = sa.Uuid(as_uuid=False)
JSON = sa.JSON(none_as_null=True).with_variant(postgresql.JSONB(none_as_null=True), "postgresql")


def upgrade() -> None:
    op.create_table(
        "celery_lease_landings",
        sa.Column("token", ID, primary_key=True),
        sa.Column("created_at", TS, nullable=False),
    )
    op.create_table(
        "celery_lease_outbox",
        sa.Column("id", ID, primary_key=True),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("payload", JSON, nullable=False),
        sa.Column("created_at", TS, nullable=False),
    )
    op.create_index("celery_lease_outbox_created", "celery_lease_outbox", ["created_at"])


def downgrade() -> None:
    op.drop_index("celery_lease_outbox_created", "celery_lease_outbox")
    op.drop_table("celery_lease_outbox")
    op.drop_table("celery_lease_landings")
