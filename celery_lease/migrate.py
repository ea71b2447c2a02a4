"""Applies celery-lease's Alembic migrations (shipped inside the package)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from .store import Store

MIGRATIONS = Path(__file__).with_name("migrations")
VERSION_TABLE = "celery_lease_alembic_version"


def _config(connection) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.attributes["connection"] = connection
    return cfg


def upgrade(store: Store, revision: str = "head") -> str:
    """Upgrade the schema to ``revision``; returns the revision now applied."""

    def work(conn):
        command.upgrade(_config(conn), revision)
        return MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE}).get_current_revision()

    return store.run(store.durable, work)


def head() -> str:
    return ScriptDirectory.from_config(_config(None)).get_current_head()
