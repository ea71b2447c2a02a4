"""Submits inside Django's ``transaction.atomic()`` join that transaction.

A submit without ``connection=`` while one of Django's connections is in an atomic block
on the *same* PostgreSQL database as the job table writes the job's rows through that
very connection and publishes its wakeups by ``transaction.on_commit``: they commit or
roll back with the caller's own rows. "Same database" is checked on the server
(database name, server start time and port), so two spellings of one host match and two
servers with one database name do not. Outside an atomic block or on another database
the submit commits on its own. Django's connection is lent to SQLAlchemy by an engine
whose dialect never commits, rolls back or closes it (:func:`_engine_for`).
"""

from __future__ import annotations

import contextvars
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from django.db import connections
from django.db import transaction as dj_transaction

from celery_lease import producer
from celery_lease.db.store import Store

#: What identifies a PostgreSQL database on its server, as both sides see it.
_IDENTITY = "SELECT current_database(), pg_postmaster_start_time(), inet_server_port()"

#: The Django DBAPI connection the borrowing engine hands out (per thread / context).
_RAW: contextvars.ContextVar[Any] = contextvars.ContextVar("celery_lease_django_raw")
_ENGINES: dict[str, sa.Engine] = {}
_STORE_IDENTITY: weakref.WeakKeyDictionary[Store, tuple] = weakref.WeakKeyDictionary()


def install() -> None:
    """Let every CeleryLease's submits join Django's atomic blocks (idempotent)."""
    if joined not in producer.AMBIENT_TRANSACTIONS:
        producer.AMBIENT_TRANSACTIONS.append(joined)


@contextmanager
def joined(store: Store) -> Iterator[sa.Connection | None]:
    """A SQLAlchemy connection in the Django transaction on ``store``'s database, or None."""
    wrapper = _atomic_on(store)
    if wrapper is None:
        yield None
        return
    raw = wrapper.connection
    token = _RAW.set(raw)
    try:
        with _engine_for(raw).connect() as conn:
            conn.info[producer.AFTER_COMMIT] = lambda fn: dj_transaction.on_commit(fn, using=wrapper.alias)
            yield conn
    finally:
        _RAW.reset(token)


def _atomic_on(store: Store) -> Any:
    """The Django connection of this thread that is in an atomic block on ``store``'s
    database (of the vendor whose transactions it can join), or None."""
    for wrapper in connections.all(initialized_only=True):
        if wrapper.vendor != store.capabilities.joinable_vendor or not wrapper.in_atomic_block or wrapper.connection is None:
            continue
        if identity_of(wrapper) == store_identity(store):
            return wrapper
    return None


def identity_of(wrapper: Any) -> tuple:
    """The server's identity of the database a Django connection is on."""
    # Cached per DBAPI connection: Django may reconnect (CONN_MAX_AGE, a dropped link).
    cached = getattr(wrapper, "_celery_lease_identity", None)
    if cached is None or cached[0] is not wrapper.connection:
        with wrapper.cursor() as cursor:
            cursor.execute(_IDENTITY)
            cached = (wrapper.connection, tuple(cursor.fetchone()))
        wrapper._celery_lease_identity = cached
    return cached[1]


def store_identity(store: Store) -> tuple:
    """The server's identity of the job database (PostgreSQL)."""
    if store not in _STORE_IDENTITY:
        with store.durable.connect() as conn:
            _STORE_IDENTITY[store] = tuple(conn.exec_driver_sql(_IDENTITY).one())
    return _STORE_IDENTITY[store]


def _engine_for(raw: Any) -> sa.Engine:
    """The borrowing engine for this DBAPI (psycopg2 or psycopg 3, as Django uses)."""
    driver = "psycopg2" if type(raw).__module__.startswith("psycopg2") else "psycopg"
    engine = _ENGINES.get(driver)
    if engine is None:
        engine = sa.create_engine(
            f"postgresql+{driver}://",
            creator=_RAW.get,
            poolclass=sa.pool.NullPool,
            pool_reset_on_return=None,
            use_native_hstore=False,
        )
        dialect: Any = engine.dialect
        # Django commits, rolls back and closes this connection; SQLAlchemy must not
        # (closing its Connection would otherwise roll the caller's transaction back).
        dialect.do_commit = dialect.do_rollback = dialect.do_close = lambda dbapi_connection: None
        engine = _ENGINES.setdefault(driver, engine)
    return engine
