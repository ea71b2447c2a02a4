"""Fair share across tenants: each pending job of a fair kind carries its place in its
kind's weighted round of tenants (celery_lease_jobs.fair_key), and tenants' weights are
stored (celery_lease_tenant_weights).

A nullable column, added without rewriting a row; the history table and the view of all
jobs take it too. Both partial indexes start empty, but building each reads
celery_lease_jobs once and writes to it wait for that. This release's code reads and
writes fair_key: migrate before starting its workers.

Revision ID: 0015_fair_share
Revises: 0014_history
"""

import sqlalchemy as sa
from alembic import op

revision = "0015_fair_share"
down_revision = "0014_history"
branch_labels = None
depends_on = None

PENDING_FAIR = "status = 'pending' AND fair_key IS NOT NULL"


def _jobs_columns() -> str:
    rows = op.get_bind().execute(
        sa.text(
            "SELECT column_name FROM information_schema.columns"
            " WHERE table_schema = current_schema() AND table_name = 'celery_lease_jobs' ORDER BY ordinal_position"
        )
    )
    return ", ".join(r[0] for r in rows)


def upgrade() -> None:
    op.add_column("celery_lease_jobs", sa.Column("fair_key", sa.Float))
    op.create_index(
        "celery_lease_jobs_fair",
        "celery_lease_jobs",
        ["kind", "queue", sa.text("coalesce(concurrency_key, '')"), sa.text("priority DESC"), "fair_key", "created_at"],
        postgresql_where=sa.text(PENDING_FAIR),
        sqlite_where=sa.text(PENDING_FAIR),
    )
    op.create_index(
        "celery_lease_jobs_fair_tenant",
        "celery_lease_jobs",
        ["kind", "tenant", "fair_key"],
        postgresql_where=sa.text(PENDING_FAIR),
        sqlite_where=sa.text(PENDING_FAIR),
    )
    op.create_table(
        "celery_lease_tenant_weights",
        sa.Column("tenant", sa.String(200), primary_key=True),
        sa.Column("weight", sa.Float, nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("weight > 0", name="celery_lease_tenant_weights_weight_check"),
    )
    if op.get_bind().dialect.name != "postgresql":
        return  # SQLite's view is SELECT * over the one table: it has the column already
    op.add_column("celery_lease_history", sa.Column("fair_key", sa.Float))
    jobs = _jobs_columns()
    op.execute(
        f"CREATE OR REPLACE VIEW celery_lease_jobs_all AS SELECT {jobs} FROM celery_lease_jobs"
        f" UNION ALL SELECT {jobs} FROM celery_lease_history"
    )


def downgrade() -> None:
    op.drop_table("celery_lease_tenant_weights")
    op.drop_index("celery_lease_jobs_fair_tenant", "celery_lease_jobs")
    op.drop_index("celery_lease_jobs_fair", "celery_lease_jobs")
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP VIEW celery_lease_jobs_all")
        op.drop_column("celery_lease_history", "fair_key")
        op.drop_column("celery_lease_jobs", "fair_key")
        jobs = _jobs_columns()
        op.execute(
            f"CREATE VIEW celery_lease_jobs_all AS SELECT {jobs} FROM celery_lease_jobs"
            f" UNION ALL SELECT {jobs} FROM celery_lease_history"
        )
        return
    with op.batch_alter_table("celery_lease_jobs") as batch:
        batch.drop_column("fair_key")
