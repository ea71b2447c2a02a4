"""Reading a source database: tables, primary keys, chunks of rows.

Engines are made per process with NullPool: a worker's pool children fork from a
parent that may have touched a source, and a pooled connection must never cross a
fork. A chunk is one short connection, so pooling would buy little.
"""

from __future__ import annotations

import base64
import datetime
import os
from typing import Any

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.pool import NullPool

from celery_lease import Failure

_engines: dict[tuple[int, str], sa.Engine] = {}


def display(url: str) -> str:
    """The URL without its password, for messages and logs."""
    return sa.make_url(url).render_as_string(hide_password=True)


def engine(url: str) -> sa.Engine:
    key = (os.getpid(), url)
    if key not in _engines:
        _engines[key] = sa.create_engine(url, poolclass=NullPool)
    return _engines[key]


def connect(url: str) -> sa.Connection:
    """A connection to the source; Failure (no retry, no driver text) when the URL
    names no usable database, since retrying cannot fix a wrong URL or driver."""
    try:
        return engine(url).connect()
    except (sa_exc.NoSuchModuleError, ImportError):
        raise Failure(f"no driver for the source database {display(url)}") from None
    except sa_exc.DBAPIError as exc:
        # The driver's message can carry host names or credentials: keep only its type.
        raise Failure(f"cannot connect to the source database {display(url)} ({type(exc.orig).__name__})") from None


def table_names(conn: sa.Connection) -> list[str]:
    return sorted(sa.inspect(conn).get_table_names())


def reflect(conn: sa.Connection, name: str) -> sa.Table:
    try:
        return sa.Table(name, sa.MetaData(), autoload_with=conn)
    except sa_exc.NoSuchTableError:
        raise Failure(f"the source has no table {name!r}") from None


def key_column(table: sa.Table) -> sa.Column:
    """The single-column primary key chunks are cut on (keyset pagination: a chunk is
    "the next N rows after key K", so a resumed extract needs only K)."""
    pk = list(table.primary_key.columns)
    if len(pk) != 1:
        raise Failure(f"table {table.name!r} has no single-column primary key; it cannot be extracted in chunks")
    try:
        python_type = pk[0].type.python_type
    except NotImplementedError:
        python_type = None
    if python_type not in (int, str):
        raise Failure(f"table {table.name!r}: primary key {pk[0].name!r} is not an integer or text column")
    return pk[0]


def count_rows(conn: sa.Connection, table: sa.Table) -> int:
    return conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one()


def read_chunk(conn: sa.Connection, table: sa.Table, after: Any, limit: int) -> list[dict]:
    """The next ``limit`` rows with key greater than ``after`` (None: from the start),
    in key order, as JSON-ready dicts."""
    key = key_column(table)
    stmt = sa.select(table).order_by(key).limit(limit)
    if after is not None:
        stmt = stmt.where(key > after)
    return [{name: json_value(value) for name, value in row.items()} for row in conn.execute(stmt).mappings()]


def json_value(value: Any) -> Any:
    """Rows travel through the staging area as JSON. Integers, floats, booleans and
    text keep their type; other values keep an exact text form (tasks/warehouse.py
    gives such columns a text type in the destination)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, (bytes, memoryview)):
        return base64.b64encode(bytes(value)).decode()
    return str(value)  # Decimal, UUID, ...: their exact text
