"""The pipeline's job kinds. Payloads are dataclasses: ``submit`` checks them (a bad
one raises InvalidPayload and stores nothing) and the handler gets the instance back.

Chaining: ``discover`` (with ``extract=True``) submits one ``extract`` per table, and
each ``extract`` submits its ``load``, each through ``ctx.submit``, so a child exists
if and only if its parent succeeded, and the whole chain shares the parent's run:
``leases.cancel_run(run_id)`` stops all of it. Handlers stop at ``raise_if_cancelled``
between tables and between chunks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc

from celery_lease import Failure, JobContext
from tasks import source, warehouse
from tasks.app import LEASE_SECONDS, leases

MAX_CHUNK_ROWS = 100_000
MAX_PREVIEW_ROWS = 100
MAX_PAUSE_SECONDS = 10.0


def _check_url(url: str) -> None:
    if not isinstance(url, str) or not url:
        raise ValueError("source must be a database URL")
    try:
        sa.make_url(url)
    except sa_exc.ArgumentError:
        raise ValueError("source is not a database URL (e.g. sqlite:///path or postgresql+psycopg2://host/db)") from None


def _check_table(name: str) -> None:
    if not isinstance(name, str) or not name or len(name) > 200:
        raise ValueError("table must be a table name")


def _check_int(name: str, value: int, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer from {low} to {high}")


def _check_pause(value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= MAX_PAUSE_SECONDS:
        raise ValueError(f"pause must be a number of seconds from 0 to {MAX_PAUSE_SECONDS:g}")


@dataclass
class SourceRef:
    source: str

    def __post_init__(self) -> None:
        _check_url(self.source)


@dataclass
class Discover:
    source: str
    #: Submit an extract (and so a load) for every table found that can be chunked.
    extract: bool = False
    #: Only these tables (default: all).
    tables: list[str] | None = None
    chunk_rows: int = 1000
    pause: float = 0.0

    def __post_init__(self) -> None:
        _check_url(self.source)
        if self.tables is not None:
            if not isinstance(self.tables, list):
                raise ValueError("tables must be a list of table names")
            for name in self.tables:
                _check_table(name)
        _check_int("chunk_rows", self.chunk_rows, 1, MAX_CHUNK_ROWS)
        _check_pause(self.pause)


@dataclass
class Preview:
    source: str
    table: str
    limit: int = 10

    def __post_init__(self) -> None:
        _check_url(self.source)
        _check_table(self.table)
        _check_int("limit", self.limit, 1, MAX_PREVIEW_ROWS)


@dataclass
class Extract:
    source: str
    table: str
    chunk_rows: int = 1000
    #: Seconds to wait after each chunk: stands in for a slow source, so progress (and
    #: a worker killed mid-extract) can be watched in the demo.
    pause: float = 0.0
    #: Submit the load of this table when the extract succeeds.
    load: bool = True

    def __post_init__(self) -> None:
        _check_url(self.source)
        _check_table(self.table)
        _check_int("chunk_rows", self.chunk_rows, 1, MAX_CHUNK_ROWS)
        _check_pause(self.pause)


@dataclass
class Load:
    extract_id: str
    table: str
    columns: list[dict] = field(default_factory=list)
    rows: int = 0
    chunks: int = 0

    def __post_init__(self) -> None:
        _check_table(self.table)
        for column in self.columns:
            if not isinstance(column, dict) or set(column) != {"name", "type"} or column["type"] not in warehouse.COLUMN_TYPES:
                raise ValueError("columns must be a list of {name, type} with type integer, float, boolean or text")


@leases.job(kind="test", max_attempts=1, lease_seconds=LEASE_SECONDS)
def check_source(ctx: JobContext, spec: SourceRef) -> dict:
    """Does the source database answer?"""
    with source.connect(spec.source) as conn:
        conn.execute(sa.text("SELECT 1"))
        return {"source": source.display(spec.source), "dialect": conn.dialect.name, "tables": len(source.table_names(conn))}


@leases.job(kind="discover", max_attempts=3, lease_seconds=LEASE_SECONDS)
def discover(ctx: JobContext, spec: Discover) -> dict:
    """The tables of the source with their row counts and primary keys."""
    found = []
    with source.connect(spec.source) as conn:
        names = source.table_names(conn)
        missing = sorted(set(spec.tables or ()) - set(names))
        if missing:
            raise Failure(f"the source has no table {', '.join(map(repr, missing))}")
        for name in spec.tables or names:
            ctx.raise_if_cancelled()
            table = source.reflect(conn, name)
            key = [c.name for c in table.primary_key.columns]
            found.append(
                {"table": name, "rows": source.count_rows(conn, table), "primary_key": key, "extractable": _extractable(table)}
            )
            ctx.publish({"tables": len(found), "of": len(spec.tables or names)})
    if spec.extract:
        for info in found:
            if info["extractable"]:
                ctx.submit(
                    "extract", Extract(source=spec.source, table=info["table"], chunk_rows=spec.chunk_rows, pause=spec.pause)
                )
    return {"tables": found}


def _extractable(table: sa.Table) -> bool:
    try:
        source.key_column(table)
    except Failure:
        return False
    return True


@leases.job(kind="preview", max_attempts=3, lease_seconds=LEASE_SECONDS)
def preview(ctx: JobContext, spec: Preview) -> dict:
    """The first rows of a table (in key order when it has a single-column key)."""
    with source.connect(spec.source) as conn:
        table = source.reflect(conn, spec.table)
        stmt = sa.select(table).limit(spec.limit)
        if _extractable(table):
            stmt = stmt.order_by(source.key_column(table))
        rows = [[source.json_value(v) for v in row] for row in conn.execute(stmt)]
    return {"table": spec.table, "columns": list(table.columns.keys()), "rows": rows}


@leases.job(kind="extract", max_attempts=3, lease_seconds=LEASE_SECONDS)
def extract(ctx: JobContext, spec: Extract) -> dict:
    """Copy a table to the staging area chunk by chunk, in key order.

    Checkpoint after each staged chunk: {"after": last key, "chunk": next chunk
    number, "rows": rows staged}. A resumed attempt reads on from "after", and
    restages (replaces) a chunk the dead attempt may have half-finished.
    """
    state = ctx.checkpoint or {"after": None, "chunk": 0, "rows": 0}
    resumed_from = state["rows"]
    jobs_db = leases.store.durable
    warehouse.ensure(jobs_db, warehouse.staging)
    with source.connect(spec.source) as conn:
        table = source.reflect(conn, spec.table)
        key = source.key_column(table)
        columns = warehouse.column_spec(table)
        total = source.count_rows(conn, table)
        ctx.publish({"rows": state["rows"], "of": total, "resumed_from": resumed_from})
        while True:
            ctx.raise_if_cancelled()
            rows = source.read_chunk(conn, table, state["after"], spec.chunk_rows)
            if not rows:
                break
            warehouse.stage_chunk(jobs_db, ctx.job_id, state["chunk"], rows)
            state = {"after": rows[-1][key.name], "chunk": state["chunk"] + 1, "rows": state["rows"] + len(rows)}
            ctx.save_checkpoint(state)  # False (lease lost) stops us at raise_if_cancelled
            ctx.publish({"rows": state["rows"], "of": max(total, state["rows"]), "resumed_from": resumed_from})
            if len(rows) < spec.chunk_rows:
                break
            time.sleep(spec.pause)
    if spec.load:
        ctx.submit(
            "load", Load(extract_id=ctx.job_id, table=spec.table, columns=columns, rows=state["rows"], chunks=state["chunk"])
        )
    return {"table": spec.table, "rows": state["rows"], "chunks": state["chunk"], "resumed_from": resumed_from}


@leases.job(kind="load", max_attempts=3, lease_seconds=LEASE_SECONDS)
def load(ctx: JobContext, spec: Load) -> dict:
    """Append the rows an extract staged to the destination table, exactly once: the
    rows are written by ``ctx.effect`` in the transaction that records this job's
    success, and the staged chunks are dropped in that same transaction."""
    jobs_db = leases.store.durable
    chunks, rows = warehouse.staged_totals(jobs_db, spec.extract_id)
    if (chunks, rows) != (spec.chunks, spec.rows):
        raise Failure(
            f"staging of extract {spec.extract_id} holds {rows} rows in {chunks} chunks, expected {spec.rows} in {spec.chunks}"
        )
    destination = warehouse.destination_table(spec.table, spec.columns)
    warehouse.ensure_destination(jobs_db, destination)
    ctx.raise_if_cancelled()

    def write(conn: sa.Connection) -> None:
        for chunk in warehouse.staged_rows(conn, spec.extract_id):
            warehouse.append_rows(conn, destination, ctx.job_id, chunk)
        warehouse.drop_staged(conn, spec.extract_id)

    ctx.effect(write)
    return {"table": spec.table, "destination": destination.name, "rows": rows}
