"""Free space on every page of celery_lease_jobs (fillfactor 70), so updates can be HOT.

Checkpoint and progress writes change no indexed column: with room on the row's own
page they are heap-only (no new index entries), where on full pages they went to
another page and into every index. Existing pages keep their fill until rewritten; new
pages get the room. PostgreSQL only.

Revision ID: 0008_jobs_fillfactor
Revises: 0007_unsuccessful_index
"""

from alembic import op

revision = "0008_jobs_fillfactor"
down_revision = "0007_unsuccessful_index"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":  # SQLite has no fillfactor
        op.execute("ALTER TABLE celery_lease_jobs SET (fillfactor = 70)")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("ALTER TABLE celery_lease_jobs RESET (fillfactor)")
