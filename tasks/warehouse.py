"""The staging area and the destination tables, both in the job database.

Why the job database: ``load`` writes its rows through ``ctx.effect``, which runs them
in the transaction that records the load's success, fenced by its lease. Either the
job is recorded succeeded *and* its rows are in, or neither: a load attempt that dies,
is reaped or is cancelled leaves no row behind, and a retry cannot load twice. That
transaction is on the job database, so that is where the destination lives.

Staging holds each extracted chunk under (extract job id, chunk number). Writing a chunk
replaces whatever that key held, so an extract resumed from its checkpoint may redo the
chunk it was writing when it died without staging anything twice.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc

from celery_lease import Failure

metadata = sa.MetaData()

staging = sa.Table(
    "pipeline_staging",
    metadata,
    sa.Column("extract_id", sa.String(36), primary_key=True),
    sa.Column("chunk", sa.Integer, primary_key=True),
    sa.Column("row_count", sa.Integer, nullable=False),
    sa.Column("rows", sa.Text, nullable=False),  # JSON array of row objects
)

#: Destination tables are named after their source table with this prefix.
DESTINATION_PREFIX = "dest_"
#: Columns every destination table adds: its own key, and the load job that wrote the
#: row (so a row loaded twice would show up under one job id twice).
ROW_COLUMN = "_row"
LOAD_JOB_COLUMN = "_load_job"

# Column types a destination keeps; everything else arrives as text (tasks/source.py).
COLUMN_TYPES = {"integer": sa.BigInteger, "float": sa.Float, "boolean": sa.Boolean, "text": sa.Text}


def ensure(engine: sa.Engine, table: sa.Table) -> None:
    """Create ``table`` unless it exists; safe when several workers race to do it."""
    try:
        table.create(engine, checkfirst=True)
    except (sa_exc.IntegrityError, sa_exc.ProgrammingError, sa_exc.OperationalError):
        # Another process created it between our check and our CREATE.
        if not sa.inspect(engine).has_table(table.name):
            raise


# --- staging ------------------------------------------------------------------------


def stage_chunk(engine: sa.Engine, extract_id: str, chunk: int, rows: list[dict]) -> None:
    with engine.begin() as conn:
        key = (staging.c.extract_id == extract_id) & (staging.c.chunk == chunk)
        conn.execute(staging.delete().where(key))
        conn.execute(
            staging.insert().values(
                extract_id=extract_id, chunk=chunk, row_count=len(rows), rows=json.dumps(rows, separators=(",", ":"))
            )
        )


def staged_totals(engine: sa.Engine, extract_id: str) -> tuple[int, int]:
    """(chunks, rows) staged by one extract."""
    stmt = sa.select(sa.func.count(), sa.func.coalesce(sa.func.sum(staging.c.row_count), 0)).where(
        staging.c.extract_id == extract_id
    )
    with engine.connect() as conn:
        chunks, rows = conn.execute(stmt).one()
    return int(chunks), int(rows)


def staged_rows(conn: sa.Connection, extract_id: str) -> Iterator[list[dict]]:
    """The staged rows of one extract, chunk by chunk in key order."""
    stmt = sa.select(staging.c.rows).where(staging.c.extract_id == extract_id).order_by(staging.c.chunk)
    for (text,) in conn.execute(stmt).all():
        yield json.loads(text)


def drop_staged(conn: sa.Connection, extract_id: str) -> None:
    conn.execute(staging.delete().where(staging.c.extract_id == extract_id))


# --- destination --------------------------------------------------------------------


def column_spec(table: sa.Table) -> list[dict[str, str]]:
    """The destination columns of a source table, as JSON for the load's payload."""
    spec = []
    for column in table.columns:
        if column.name in (ROW_COLUMN, LOAD_JOB_COLUMN):
            raise Failure(f"table {table.name!r} has a column named {column.name!r}, which the destination reserves")
        try:
            python_type = column.type.python_type
        except NotImplementedError:
            python_type = None
        kind = {bool: "boolean", int: "integer", float: "float"}.get(python_type, "text")
        spec.append({"name": column.name, "type": kind})
    return spec


def destination_name(source_table: str) -> str:
    return f"{DESTINATION_PREFIX}{source_table}"


def destination_table(source_table: str, columns: list[dict[str, str]]) -> sa.Table:
    return sa.Table(
        destination_name(source_table),
        sa.MetaData(),
        sa.Column(ROW_COLUMN, sa.Integer, primary_key=True, autoincrement=True),
        sa.Column(LOAD_JOB_COLUMN, sa.String(36), nullable=False, index=True),
        *(sa.Column(c["name"], COLUMN_TYPES[c["type"]]()) for c in columns),
    )


def ensure_destination(engine: sa.Engine, table: sa.Table) -> None:
    """Create the destination table, or check that the existing one fits."""
    ensure(engine, table)
    existing = {c["name"] for c in sa.inspect(engine).get_columns(table.name)}
    if existing != set(table.columns.keys()):
        raise Failure(f"destination table {table.name!r} exists with other columns than the source table")


def append_rows(conn: sa.Connection, table: sa.Table, load_job: str, rows: list[dict[str, Any]]) -> None:
    if rows:
        conn.execute(table.insert(), [{**row, LOAD_JOB_COLUMN: load_job} for row in rows])
