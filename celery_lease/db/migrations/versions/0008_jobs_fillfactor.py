"""Free space on every page of celery_lease_jobs (fillfactor 70), so updates can be HOT.

An update is HOT (heap-only: no new entry in any index) when it changes no indexed
column, no partial-index predicate column, and its new row version fits on the row's
own page. Filled to 100% by submits, the pages had no room: checkpoint and progress
writes, which touch no indexed column, went to another page and into every index
anyway. At 70% each page keeps room for the next versions of its rows; page pruning
reclaims the dead ones. The transitions themselves (claim, completion, renewal) change
``status`` (every partial index's predicate) or ``lease_expires_at`` (the key of the
running index, which keeps a reap tick reading the expired leases alone) and stay
non-HOT; they now write their new version on the same page more often.

Existing pages keep their fill until rewritten; new pages get the room.

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
