"""db without services: database URLs (driver, multi-host, a password never shown) and
what counts as a value the database refused."""

from __future__ import annotations

import pytest
from sqlalchemy import exc as sa_exc

from celery_lease.db.engine import Database
from celery_lease.db.refused import refused_value
from celery_lease.errors import ConfigurationError, InvalidPayload


def test_a_database_refusal_is_recognised_as_a_refused_value():
    class PgDataError(Exception):
        pgcode = "22P05"  # untranslatable character

    class PgOther(Exception):
        pgcode = "40001"

    assert refused_value(ValueError("A string literal cannot contain NUL (0x00) characters."))
    assert refused_value(UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed"))
    assert refused_value(PgDataError())
    assert refused_value(sa_exc.DataError("INSERT ...", {}, PgDataError()))
    assert refused_value(sa_exc.StatementError("boom", "INSERT ...", {}, ValueError("NUL")))
    assert not refused_value(PgOther())
    assert not refused_value(InvalidPayload("ours"))
    assert not refused_value(RuntimeError("a bug"))


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://user:hunter2-secret",  # the password read as a port
        "postgresql+psycopg2://user:hunter2-secret@db:notaport/shop",
        "postgresql+psycopg2://user:hunter2-secret@[::1/shop",
        "not a url hunter2-secret",
        "mysql://user:hunter2-secret@db/shop",
    ],
)
def test_a_malformed_database_url_never_shows_its_password(url):
    with pytest.raises(ConfigurationError) as caught:
        Database.parse_url(url, "CELERY_LEASE_DATABASE_URL")
    assert "hunter2" not in str(caught.value) and "CELERY_LEASE_DATABASE_URL" in str(caught.value)
    assert caught.value.__cause__ is None and (caught.value.__suppress_context__ or caught.value.__context__ is None)


@pytest.mark.parametrize("scheme", ["postgresql", "postgres"])
def test_a_bare_postgresql_url_uses_the_installed_driver(scheme):
    # SQLAlchemy 2.1 maps a bare postgresql:// to psycopg 3, which celery-lease does not take.
    url = Database.parse_url(f"{scheme}://shop:pw@db:5432/shop")
    assert url.drivername == "postgresql+psycopg2"
    assert (url.username, url.password, url.host, url.port, url.database) == ("shop", "pw", "db", 5432, "shop")
    assert Database.parse_url("postgresql+psycopg2://db/shop").drivername == "postgresql+psycopg2"


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+psycopg://user:hunter2-secret@db/shop",
        "postgresql+pg8000://user:hunter2-secret@db/shop",
        "postgresql+nosuch://db/shop",
    ],
)
def test_a_postgresql_url_on_another_driver_than_psycopg2_is_refused_naming_the_fix(url):
    """psycopg 3 is installed here (the bench's extra) and SQLAlchemy takes it, but a
    prepared statement fails on it and a retried claim could not wait for its first
    try: refused when CeleryLease is built, not at the first job."""
    with pytest.raises(ConfigurationError) as caught:
        Database.parse_url(url, "CELERY_LEASE_DATABASE_URL")
    message = str(caught.value)
    assert "psycopg2" in message and "postgresql+psycopg2://" in message and "CELERY_LEASE_DATABASE_URL" in message
    assert "hunter2" not in message


def test_a_database_url_whose_driver_is_missing_names_the_fix(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_psycopg2(name, *args, **kwargs):
        if name.split(".")[0] == "psycopg2":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_psycopg2)
    with pytest.raises(ConfigurationError) as caught:
        Database.parse_url("postgresql://user:hunter2-secret@db/shop", "CELERY_LEASE_DATABASE_URL")
    message = str(caught.value)
    assert "is not installed" in message and "pip install psycopg2-binary" in message and "hunter2" not in message


@pytest.mark.parametrize(
    "query",
    [
        "host=db1:5432,db2:5433&target_session_attrs=read-write",  # libpq's list in one parameter
        "host=db1:5432&host=db2:5433&target_session_attrs=read-write",
        "host=db1,db2&port=5432,5433&target_session_attrs=read-write",
    ],
)
def test_a_multi_host_url_reaches_libpq_as_a_host_list_and_a_port_list(query):
    """libpq's failover form, as every guide writes it. (``host=h1:p1,h2:p2`` reached
    libpq as one host named "db1:5432,db2:5433" and the port list ",": it never
    connected.)"""
    url = Database.parse_url(f"postgresql+psycopg2://shop:pw@/shop?{query}")
    _, args = url.get_dialect()().create_connect_args(url)
    assert (args["host"], args["port"]) == ("db1,db2", "5432,5433")
    assert args["target_session_attrs"] == "read-write"
    assert "pw" not in Database(url.render_as_string(hide_password=False)).display_url


def test_a_url_mixing_two_host_list_forms_is_refused_at_the_boundary():
    with pytest.raises(ConfigurationError) as caught:
        Database.parse_url("postgresql+psycopg2://shop:hunter2@/shop?host=db1:5432&host=db2:5433&port=5432", "database_url")
    assert "two forms" in str(caught.value) and "hunter2" not in str(caught.value)


def test_display_url_masks_every_password():
    url = "postgresql+psycopg2://u:inline-secret@h/db?password=qs-secret&sslpassword=ssl-secret&sslmode=require"
    shown = Database(url).display_url
    assert "secret" not in shown and "sslmode=require" in shown and "u:***@h" in shown
