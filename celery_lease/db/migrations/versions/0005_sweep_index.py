"""The sweep reads only what it sends: celery_lease_jobs_wakeup replaces celery_lease_jobs_pending.

celery_lease_jobs_pending (run_after, every pending job) made each sweep tick read every
pending job already woken (a million of them: 180 ms a tick). The new index is keyed on
(woken_at, run_after) and leaves held jobs out, so each range the sweep reads holds only
jobs it must wake (statements.maintenance.claim_due_wakeups). Each pending job is in one index either
way: a submit pays the same.

Revision ID: 0005_sweep_index
Revises: 0004_flow
"""

import sqlalchemy as sa
from alembic import op

revision = "0005_sweep_index"
down_revision = "0004_flow"
branch_labels = None
depends_on = None


def _partial(where: str) -> dict:
    return {"postgresql_where": sa.text(where), "sqlite_where": sa.text(where)}


def upgrade() -> None:
    op.create_index("celery_lease_jobs_wakeup", "celery_lease_jobs", ["woken_at", "run_after"],
                    **_partial("status = 'pending' AND held IS NULL"))
    op.drop_index("celery_lease_jobs_pending", table_name="celery_lease_jobs")


def downgrade() -> None:
    op.create_index("celery_lease_jobs_pending", "celery_lease_jobs", ["run_after"], **_partial("status = 'pending'"))
    op.drop_index("celery_lease_jobs_wakeup", table_name="celery_lease_jobs")
