"""Finished jobs past the hot table: celery_lease_history and celery_lease_history_events,
range-partitioned by the day a job finished (PostgreSQL), and the views reads go
through, celery_lease_jobs_all and celery_lease_events_all (both dialects; on SQLite
over the one table).

Online: the new tables are empty, their indexes are built on no rows, and a view takes
no lock that blocks a worker; nothing of celery_lease_jobs is rewritten. Jobs move over
afterwards, a bounded batch per archive tick (db/history.py), while workers work.

Revision ID: 0014_history
Revises: 0013_kind_limits
"""

import sqlalchemy as sa
from alembic import op

revision = "0014_history"
down_revision = "0013_kind_limits"
branch_labels = None
depends_on = None

UNSUCCESSFUL = "status IN ('cancelled', 'expired', 'failed')"
TERMINAL = "status IN ('cancelled', 'expired', 'failed', 'succeeded')"


def _columns(table: str) -> str:
    rows = op.get_bind().execute(
        sa.text(
            "SELECT column_name FROM information_schema.columns"
            " WHERE table_schema = current_schema() AND table_name = :t ORDER BY ordinal_position"
        ),
        {"t": table},
    )
    return ", ".join(r[0] for r in rows)


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        op.execute("CREATE VIEW celery_lease_jobs_all AS SELECT * FROM celery_lease_jobs")
        op.execute("CREATE VIEW celery_lease_events_all AS SELECT * FROM celery_lease_events")
        return
    # LIKE: the same columns, types, NOT NULLs and defaults; no key, none of the jobs
    # table's checks (rows arrive checked), no storage parameters (history is written
    # once, never updated).
    op.execute("CREATE TABLE celery_lease_history (LIKE celery_lease_jobs INCLUDING DEFAULTS) PARTITION BY RANGE (finished_at)")
    # Finished jobs only: reads of pending or running jobs skip the history's partitions.
    op.execute(f"ALTER TABLE celery_lease_history ADD CONSTRAINT celery_lease_history_status_check CHECK ({TERMINAL})")
    op.execute(
        "CREATE TABLE celery_lease_history_events (LIKE celery_lease_events, finished_at timestamptz NOT NULL)"
        " PARTITION BY RANGE (finished_at)"
    )
    for name, definition in (
        ("celery_lease_history_id", "celery_lease_history (id)"),
        ("celery_lease_history_created", "celery_lease_history (created_at, id)"),
        ("celery_lease_history_kind", "celery_lease_history (kind, created_at, id)"),
        ("celery_lease_history_tenant", "celery_lease_history (tenant, created_at, id) WHERE tenant IS NOT NULL"),
        ("celery_lease_history_unsuccessful", f"celery_lease_history (status, created_at, id) WHERE {UNSUCCESSFUL}"),
        ("celery_lease_history_run", "celery_lease_history (run_id) WHERE run_id IS NOT NULL"),
        ("celery_lease_history_finished", "celery_lease_history (finished_at)"),
        ("celery_lease_history_events_run", "celery_lease_history_events (run_id, id)"),
        ("celery_lease_history_events_job", "celery_lease_history_events (job_id)"),
    ):
        op.execute(f"CREATE INDEX {name} ON {definition}")
    jobs, events = _columns("celery_lease_jobs"), _columns("celery_lease_events")
    op.execute(
        f"CREATE VIEW celery_lease_jobs_all AS SELECT {jobs} FROM celery_lease_jobs"
        f" UNION ALL SELECT {jobs} FROM celery_lease_history"
    )
    op.execute(
        f"CREATE VIEW celery_lease_events_all AS SELECT {events} FROM celery_lease_events"
        f" UNION ALL SELECT {events} FROM celery_lease_history_events"
    )


def downgrade() -> None:
    # Archived jobs go back to the one table first (their partitions are dropped with it).
    op.execute("DROP VIEW celery_lease_jobs_all")
    op.execute("DROP VIEW celery_lease_events_all")
    if op.get_bind().dialect.name != "postgresql":
        return
    jobs, events = _columns("celery_lease_jobs"), _columns("celery_lease_events")
    op.execute(f"INSERT INTO celery_lease_jobs ({jobs}) SELECT {jobs} FROM celery_lease_history")
    op.execute(f"INSERT INTO celery_lease_events ({events}) SELECT {events} FROM celery_lease_history_events")
    op.execute("DROP TABLE celery_lease_history_events")
    op.execute("DROP TABLE celery_lease_history")
