"""One canonical schema: the shipped migrations must reproduce celery_lease.schema exactly."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from celery_lease.db import migrate
from celery_lease.db.schema import history_metadata, metadata
from celery_lease.db.statements import attempt
from celery_lease.db.statements.history import PARTITION
from celery_lease.db.store import Store
from tests.conftest import throwaway_database


def _declared(dialect: str) -> sa.MetaData:
    """The declared schema of a dialect: PostgreSQL has the partitioned history too."""
    if dialect != "postgresql":
        return metadata
    both = sa.MetaData()
    for table in (*metadata.tables.values(), *history_metadata.tables.values()):
        table.to_metadata(both)
    return both


def _ours(name, type_, parent) -> bool:
    # A day's partition of the history is made by the archive, not by a migration.
    return type_ != "table" or (name.startswith("celery_lease_") and not PARTITION.match(name))


def _diff(url: str) -> list:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(
                conn,
                opts={
                    "compare_type": True,
                    "compare_server_default": True,
                    "include_name": _ours,
                },
            )
            ignored = {"test_effects", migrate.VERSION_TABLE}  # not part of the declared schema
            return [
                d
                for d in compare_metadata(ctx, _declared(engine.dialect.name))
                if not (isinstance(d, tuple) and d[0] == "remove_table" and d[1].name in ignored)
            ]
    finally:
        engine.dispose()


def test_migrated_postgresql_schema_equals_declared(pg):
    assert _diff(pg) == []


def test_migrated_sqlite_schema_equals_declared(tmp_path):
    url = f"sqlite:///{tmp_path / 'schema.sqlite3'}"
    assert migrate.upgrade(Store(url)) == migrate.head()
    assert _diff(url) == []


def test_partial_indexes_on_postgresql(pg):
    engine = sa.create_engine(pg)
    with engine.connect() as conn:
        defs = dict(
            conn.exec_driver_sql("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'celery_lease_jobs'").all()
        )
    engine.dispose()
    assert "WHERE" in defs["celery_lease_jobs_wakeup"] and "'pending'" in defs["celery_lease_jobs_wakeup"]
    assert "held IS NULL" in defs["celery_lease_jobs_wakeup"]
    assert "'running'" in defs["celery_lease_jobs_running"]
    assert "'succeeded'" in defs["celery_lease_jobs_finished"]


def test_status_check_constraint_rejects_unknown_status(pg, make_job):
    with pytest.raises(sa.exc.IntegrityError):
        make_job(pg, status="leased")


def test_create_schema_is_idempotent(pg, broker, client_app):
    mod = client_app(pg, broker)
    assert mod.leases.create_schema() == migrate.head()
    assert mod.leases.create_schema() == migrate.head()


# (A history partition, celery_lease_history_pYYYYMMDD, is made by the archive.)
CATALOG = {
    "columns": """SELECT table_name, column_name, data_type, is_nullable, column_default
                  FROM information_schema.columns WHERE table_name LIKE 'celery_lease_%'
                  AND table_name <> 'celery_lease_alembic_version' AND table_name !~ '_p[0-9]{8}$'
                  ORDER BY 1, 2""",
    "indexes": """SELECT indexname, indexdef FROM pg_indexes
                  WHERE tablename LIKE 'celery_lease_%' AND tablename <> 'celery_lease_alembic_version'
                  AND tablename !~ '_p[0-9]{8}$' ORDER BY 1""",
    "constraints": """SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid) FROM pg_constraint
                      WHERE conrelid::regclass::text LIKE 'celery_lease_%'
                      AND conrelid::regclass::text <> 'celery_lease_alembic_version'
                      AND conrelid::regclass::text !~ '_p[0-9]{8}$' ORDER BY 1, 2""",
    # Storage parameters (the jobs table's fillfactor): autogenerate does not compare them.
    "storage": """SELECT relname, reloptions FROM pg_class WHERE relkind = 'r' AND relname LIKE 'celery_lease_%'
                  AND relname <> 'celery_lease_alembic_version' AND relname !~ '_p[0-9]{8}$' ORDER BY 1""",
}


def test_migrations_reproduce_create_all_exactly_in_the_catalog(pg):
    """Stronger than autogenerate: CHECK constraints and partial-index predicates too."""
    with throwaway_database("celery_lease_declared") as declared_url:
        declared = sa.create_engine(declared_url)
        migrated = sa.create_engine(pg)
        try:
            metadata.create_all(declared)
            history_metadata.create_all(declared)
            with declared.begin() as d:
                for view, table, history in (
                    ("celery_lease_jobs_all", "celery_lease_jobs", "celery_lease_history"),
                    ("celery_lease_events_all", "celery_lease_events", "celery_lease_history_events"),
                ):
                    columns = ", ".join(c.name for c in metadata.tables[table].columns)
                    d.exec_driver_sql(
                        f"CREATE VIEW {view} AS SELECT {columns} FROM {table} UNION ALL SELECT {columns} FROM {history}"
                    )
            with declared.connect() as d, migrated.connect() as m:
                for what, sql in CATALOG.items():
                    assert d.execute(sa.text(sql)).all() == m.execute(sa.text(sql)).all(), what
        finally:
            declared.dispose()
            migrated.dispose()


def test_a_write_that_changes_no_indexed_column_stays_on_its_page(pg):
    """Room left on every page of the jobs table (fillfactor, migration 0008): a
    checkpoint or progress write of a job on a page filled by submits is HOT, no new
    entry in any index. With full pages each such write moved its row to another page
    and into all the indexes."""
    fill = (
        "INSERT INTO celery_lease_jobs (id, kind, task, status, attempt, max_attempts, lease_seconds, lease_generation,"
        " lease_owner, lease_expires_at, payload, created_at, updated_at) SELECT gen_random_uuid(), 'echo',"
        " 'tests.apps.app.echo', 'running', 1, 3, 30, 1, 'w/1/b', now() + interval '1 minute', '{}'::jsonb, now(), now()"
        " FROM generate_series(1, 400)"
    )
    engine = sa.create_engine(pg)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(fill)  # several pages, each filled as far as inserts go
            first_page = conn.exec_driver_sql(
                "SELECT id FROM celery_lease_jobs WHERE (ctid::text::point)[0] = 0 ORDER BY ctid LIMIT 10"
            ).all()
            for (job_id,) in first_page[:5]:
                conn.execute(attempt.save_checkpoint(), {"job_id": job_id, "generation": 1, "new_checkpoint": {"n": 1}})
            for (job_id,) in first_page[5:]:
                conn.execute(attempt.publish_progress(), {"job_id": job_id, "generation": 1, "new_progress": {"done": 1}})
            updated, hot = conn.exec_driver_sql(
                "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables WHERE relname = 'celery_lease_jobs'"
            ).one()
    finally:
        engine.dispose()
    assert (updated, hot) == (10, 10)


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_a_submit_to_an_unmigrated_database_names_the_migrate_command(tmp_path, dialect):
    from contextlib import ExitStack

    from celery import Celery

    from celery_lease import CeleryLease
    from celery_lease.errors import ConfigurationError

    with ExitStack() as stack:
        if dialect == "sqlite":
            url = f"sqlite:///{tmp_path / 'never-migrated.sqlite3'}"
        else:
            url = stack.enter_context(throwaway_database("celery_lease_unmigrated"))
        leases = CeleryLease(Celery("unmigrated", broker="memory://", set_as_current=False), url, install_beat=False)

        @leases.job(kind="unmigrated")
        def handler(ctx, payload):
            return payload

        try:
            # Not a raw UndefinedTable (nor "cannot reach the database"): what to run.
            with pytest.raises(ConfigurationError, match=r"celery -A proj lease migrate.*leases\.create_schema\(\)"):
                handler.submit({"n": 1})
            leases.create_schema()
            assert handler.submit({"n": 1}).kind == "unmigrated"
        finally:
            leases.store.dispose()
