"""Database URLs: where the job database's URL comes from, how it is checked at the
boundary, and how it is shown (never with its password).

``database_url`` names the primary; libpq's multi-host form (``?host=h1:p1&host=h2:p2``
or ``?host=h1:p1,h2:p2``, with ``target_session_attrs=read-write``) lists a primary and
its standbys, so that a promoted standby is found without a restart.
``lease_read_database_url`` names a replica for the reads that may lag.
"""

from __future__ import annotations

import os
from typing import Any

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import make_url

from celery_lease.errors import ConfigurationError

DEFAULT_SQLITE_PATH = "celery-lease.sqlite3"
#: The driver behind a bare ``postgresql://`` (or ``postgres://``) URL, and the only
#: PostgreSQL driver taken (SQLAlchemy 2.1 alone would pick psycopg 3): the guarantees
#: read its connection (the backend pid a retry after a dropped connection waits for,
#: db/in_flight.py; prepared statements sent as EXECUTE, db/prepared.py) and make it
#: cooperate with gevent and eventlet (green.py). On another driver they would not hold,
#: silently: a prepared statement fails, a retried claim races its first try.
POSTGRESQL_DRIVER = "postgresql+psycopg2"
#: Query-string parameters of a database URL that carry a secret (libpq accepts both).
SECRET_QUERY_KEYS = frozenset({"password", "sslpassword"})
#: What messages call the replica's URL (celery_lease/settings.py: read_database_url).
READ_SOURCE = "lease_read_database_url"


def resolve_database_url(explicit: str | None, app_conf: Any) -> tuple[str, str]:
    """Return (url, where it came from). Precedence: argument, app.conf, environment,
    then a SQLite file in the working directory."""
    if explicit:
        return explicit, "database_url"
    conf_value = app_conf.get("lease_database_url") if app_conf is not None else None
    if conf_value:
        return conf_value, "app.conf.lease_database_url"
    env_value = os.environ.get("CELERY_LEASE_DATABASE_URL")
    if env_value:
        return env_value, "CELERY_LEASE_DATABASE_URL"
    return f"sqlite:///{os.path.abspath(DEFAULT_SQLITE_PATH)}", "default SQLite file"


def parse_url(url: str, source: str = "database_url") -> sa.URL:
    """Check a database URL at the boundary; ConfigurationError names the setting
    and never echoes the URL (it may carry a password)."""
    try:
        parsed = make_url(url)
    except (sa_exc.ArgumentError, ValueError, TypeError):
        # ValueError: a non-numeric port, e.g. the password of "postgresql://user:pw"
        # read as host:port; its text would quote it.
        raise ConfigurationError(
            f"{source} is not a valid database URL (expected e.g. postgresql+psycopg2://user@host/db or sqlite:///path)"
        ) from None
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername=POSTGRESQL_DRIVER)
    if parsed.get_backend_name() not in ("postgresql", "sqlite"):
        raise ConfigurationError(
            f"{source} names the unsupported database {parsed.get_backend_name()!r}: celery-lease runs on PostgreSQL or SQLite"
        )
    if parsed.get_backend_name() == "postgresql" and parsed.drivername != POSTGRESQL_DRIVER:
        raise ConfigurationError(
            f"{source} names the PostgreSQL driver {parsed.get_driver_name()!r}: celery-lease runs PostgreSQL on psycopg2 "
            f"(its guarantees depend on it): write the URL as postgresql://user@host/db or {POSTGRESQL_DRIVER}://user@host/db"
        )
    try:
        parsed.get_dialect().import_dbapi()
    except (sa_exc.NoSuchModuleError, ImportError) as exc:
        fix = "pip install psycopg2-binary" if parsed.drivername == POSTGRESQL_DRIVER else "install it"
        raise ConfigurationError(
            f"{source}: the database driver of {parsed.drivername!r} is not installed ({type(exc).__name__}): {fix}"
        ) from None
    if parsed.get_backend_name() == "postgresql":
        parsed = host_list(parsed, source)
    return parsed


def parse_read_url(read_url: str, primary: sa.URL) -> sa.URL:
    """The replica's URL (lease_read_database_url), checked like the primary's; a
    replica only makes sense beside a PostgreSQL primary."""
    parsed = parse_url(read_url, READ_SOURCE)
    if primary.get_backend_name() != "postgresql" or parsed.get_backend_name() != "postgresql":
        raise ConfigurationError(f"{READ_SOURCE} names a replica: it needs PostgreSQL, for it and for the database_url")
    return parsed


def masked(url: sa.URL) -> str:
    secret = {k: "***" for k in url.query if k.lower() in SECRET_QUERY_KEYS}
    return url.update_query_dict(secret).render_as_string(hide_password=True)


def host_list(url: sa.URL, source: str) -> sa.URL:
    """A PostgreSQL URL whose hosts libpq will read as meant.

    libpq's multi-host form (a primary and its standbys, with
    ``target_session_attrs=read-write``: after a failover it connects to the promoted
    one) is written ``?host=h1:p1,h2:p2`` in one parameter in most guides; SQLAlchemy
    hands that to libpq as one host named "h1:p1,h2:p2" with a port list of commas,
    which never connects. It is rewritten as ``host=h1:p1&host=h2:p2``, the form
    SQLAlchemy splits (``host=h1,h2&port=p1,p2`` already works). A URL mixing the forms
    is refused here rather than at the first connection."""
    hosts = url.query.get("host")
    if isinstance(hosts, str) and "," in hosts and ":" in hosts and "port" not in url.query:
        url = url.update_query_dict({"host": tuple(h.strip() for h in hosts.split(","))})
    try:
        url.get_dialect()().create_connect_args(url)
    except (sa_exc.ArgumentError, ValueError):
        raise ConfigurationError(
            f"{source} lists its hosts in two forms at once: write ?host=h1:p1&host=h2:p2 (or ?host=h1,h2&port=p1,p2)"
        ) from None
    return url


def from_django(settings_dict: dict[str, Any], vendor: str, alias: str) -> str:
    """The URL of a Django database (its ``DATABASES`` entry as the connection holds it,
    e.g. with the test database's name); ConfigurationError unless it is PostgreSQL."""
    if vendor != "postgresql":
        raise ConfigurationError(f"Django's database {alias!r} is {vendor}: only a PostgreSQL database can be the job database")
    return sa.engine.URL.create(
        POSTGRESQL_DRIVER,  # celery-lease's driver, whichever Django uses
        username=settings_dict.get("USER") or None,
        password=settings_dict.get("PASSWORD") or None,
        host=settings_dict.get("HOST") or None,
        port=int(settings_dict["PORT"]) if settings_dict.get("PORT") else None,
        database=settings_dict["NAME"],
    ).render_as_string(hide_password=False)
