"""The history test's tables (tests/apps/app_history.py writes them, tests/e2e reads
them), apart from the app so that creating them registers no job kind."""

from __future__ import annotations

import sqlalchemy as sa

# In the history database (another server than the jobs').
history_metadata = sa.MetaData()
bodies = sa.Table(
    "history_bodies",
    history_metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("job_id", sa.String(36), nullable=False),
    sa.Column("kind", sa.String(50), nullable=False),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("generation", sa.BigInteger, nullable=False),
    sa.Column("holder", sa.String(64), nullable=False),  # pid-nonce of the process
    sa.Column("pid", sa.Integer, nullable=False),
    sa.Column("started_at", sa.Float, nullable=False),  # time.time() on the worker's host
    sa.Column("ended_at", sa.Float),
    sa.Column("outcome", sa.String(16)),  # returned, snoozed, failed, raised, cancelled
)
writes = sa.Table(
    "history_writes",
    history_metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("job_id", sa.String(36), nullable=False),
    sa.Column("generation", sa.BigInteger, nullable=False),
    sa.Column("holder", sa.String(64), nullable=False),
    sa.Column("step", sa.Integer, nullable=False),
    sa.Column("at", sa.Float, nullable=False),
)
# In the jobs' database: written by ctx.effect inside the success transaction.
effect_metadata = sa.MetaData()
effects = sa.Table(
    "history_effects",
    effect_metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("job_id", sa.String(36), nullable=False),
    sa.Column("kind", sa.String(50), nullable=False),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("generation", sa.BigInteger, nullable=False),
    sa.Column("note", sa.String(64)),
)
