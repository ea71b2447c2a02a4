"""Applies celery-lease's Alembic migrations (shipped inside the package).

Alembic is imported when a migration runs, not with the package: every worker process
imports celery-lease, and none of them needs Alembic's memory to run jobs.
"""

from __future__ import annotations

from pathlib import Path

from celery_lease.db.store import Store

MIGRATIONS = Path(__file__).with_name("migrations")
VERSION_TABLE = "celery_lease_alembic_version"


def _config(connection):
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.attributes["connection"] = connection
    return cfg


def upgrade(store: Store, revision: str = "head") -> str:
    """Upgrade the schema to ``revision``; returns the revision now applied."""
    from alembic import command
    from alembic.runtime.migration import MigrationContext

    def work(conn):
        command.upgrade(_config(conn), revision)
        return MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE}).get_current_revision()

    return store.transaction(store.durable, work)


def head() -> str:
    from alembic.script import ScriptDirectory

    return str(ScriptDirectory.from_config(_config(None)).get_current_head())
