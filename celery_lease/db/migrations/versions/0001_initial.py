"""Jobs, runs and the run event log.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

JSON = sa.JSON(none_as_null=True).with_variant(postgresql.JSONB(none_as_null=True), "postgresql")
TS = sa.DateTime(timezone=True)
ID = sa.Uuid(as_uuid=False)
STATUSES = "'pending', 'running', 'succeeded', 'failed', 'expired', 'cancelled'"
EVENTS = "'dispatched', 'claimed', 'retried', 'reaped', 'requeued', 'failed', 'cancelled', 'succeeded'"
TERMINAL = "'cancelled', 'expired', 'failed', 'succeeded'"


def _partial(where: str) -> dict:
    return {"postgresql_where": sa.text(where), "sqlite_where": sa.text(where)}


def upgrade() -> None:
    op.create_table(
        "celery_lease_jobs",
        sa.Column("id", ID, primary_key=True),
        sa.Column("kind", sa.String(200), nullable=False),
        sa.Column("task", sa.String(255), nullable=False),
        sa.Column("queue", sa.String(200)),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False, server_default="0"),
        sa.Column("max_attempts", sa.Integer, nullable=False),
        sa.Column("lease_seconds", sa.Integer, nullable=False),
        sa.Column("lease_generation", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("lease_owner", sa.String(255)),
        sa.Column("lease_expires_at", TS),
        sa.Column("lease_losses", sa.Integer, nullable=False, server_default="0"),
        sa.Column("run_after", TS),
        sa.Column("woken_at", TS),
        sa.Column("payload", JSON, nullable=False),
        sa.Column("result", JSON),
        sa.Column("progress", JSON),
        sa.Column("error", sa.Text),
        sa.Column("checkpoint", JSON),
        sa.Column("run_id", ID),
        sa.Column("parent_id", ID),
        sa.Column("idempotency_key", sa.String(255)),
        sa.Column("tenant", sa.String(200)),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.Column("started_at", TS),
        sa.Column("finished_at", TS),
        sa.CheckConstraint(f"status IN ({STATUSES})", name="celery_lease_jobs_status_check"),
        sa.CheckConstraint("attempt >= 0 AND max_attempts >= 1", name="celery_lease_jobs_attempts_check"),
    )
    op.create_index("celery_lease_jobs_idempotency_key", "celery_lease_jobs", ["kind", "idempotency_key"],
                    unique=True, **_partial("idempotency_key IS NOT NULL"))
    op.create_index("celery_lease_jobs_pending", "celery_lease_jobs", ["run_after"],
                    **_partial("status = 'pending'"))
    op.create_index("celery_lease_jobs_running", "celery_lease_jobs", ["lease_expires_at"],
                    **_partial("status = 'running'"))
    op.create_index("celery_lease_jobs_finished", "celery_lease_jobs", ["finished_at"],
                    **_partial(f"status IN ({TERMINAL})"))
    op.create_index("celery_lease_jobs_run", "celery_lease_jobs", ["run_id"],
                    **_partial("run_id IS NOT NULL"))
    op.create_index("celery_lease_jobs_created", "celery_lease_jobs", ["created_at", "id"])

    op.create_table(
        "celery_lease_runs",
        sa.Column("id", ID, primary_key=True),
        sa.Column("cancelled_at", TS),
        sa.Column("created_at", TS, nullable=False),
    )

    op.create_table(
        "celery_lease_events",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True,
                  autoincrement=True),
        sa.Column("run_id", ID, nullable=False),
        sa.Column("job_id", ID, nullable=False),
        sa.Column("event", sa.String(16), nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("detail", sa.Text),
        sa.Column("created_at", TS, nullable=False),
        sa.CheckConstraint(f"event IN ({EVENTS})", name="celery_lease_events_event_check"),
    )
    op.create_index("celery_lease_events_run", "celery_lease_events", ["run_id", "id"])
    op.create_index("celery_lease_events_job", "celery_lease_events", ["job_id"])


def downgrade() -> None:
    op.drop_table("celery_lease_events")
    op.drop_table("celery_lease_runs")
    op.drop_table("celery_lease_jobs")
