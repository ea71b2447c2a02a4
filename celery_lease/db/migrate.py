"""Applies celery-lease's Alembic migrations (shipped inside the package).

Alembic is imported when a migration runs, not with the package: every worker process
imports celery-lease, and none of them needs Alembic's memory to run jobs.
"""

from __future__ import annotations

from pathlib import Path

from celery_lease.db.store import Store

MIGRATIONS = Path(__file__).with_name("migrations")
VERSION_TABLE = "celery_lease_alembic_version"
#: The error when the tables are missing or older than this version of celery-lease.
SCHEMA_MISSING = (
    "the job database lacks celery-lease's tables or columns (run: celery -A proj lease migrate, "
    "or leases.create_schema(); with Django: manage.py migrate); nothing was stored"
)

#: PostgreSQL's undefined_table and undefined_column.
_UNDEFINED = frozenset({"42P01", "42703"})
_SQLITE_UNDEFINED = ("no such table", "no such column", "has no column named")


def schema_missing(exc: BaseException) -> bool:
    """Whether ``exc`` (or the database error it was raised from) says that a table or
    column of celery-lease's schema does not exist: the migrations were never applied,
    or are older than this version. Our statements are fixed, so nothing else causes it."""
    seen: BaseException | None = exc
    for _ in range(4):  # the error, and what it was translated from
        if seen is None:
            return False
        orig = getattr(seen, "orig", seen)
        code = getattr(orig, "pgcode", None) or getattr(orig, "sqlstate", None)  # psycopg2, psycopg 3
        if code in _UNDEFINED:
            return True
        if type(orig).__module__ == "sqlite3" and any(text in str(orig) for text in _SQLITE_UNDEFINED):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


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
