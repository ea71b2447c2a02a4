"""Alembic environment for celery-lease's own tables.

celery-lease keeps its revision in its own version table, so it never collides with
the Alembic history of the application that embeds it.
"""

from alembic import context

from celery_lease.db.schema import metadata

VERSION_TABLE = "celery_lease_alembic_version"


def run_migrations_online() -> None:
    connection = context.config.attributes["connection"]
    context.configure(
        connection=connection,
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        render_as_batch=connection.dialect.name == "sqlite",
        include_name=lambda name, type_, parent: type_ != "table" or str(name).startswith("celery_lease_"),
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():  # pragma: no cover
    raise SystemExit("celery-lease migrations run online: use `celery -A proj lease migrate`")
run_migrations_online()
