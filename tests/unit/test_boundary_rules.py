"""Boundary rules of issue 10 that need no service: what is storable, what a cancel
notice or a beat tick must look like, what the API's statements read, what the
terminal is shown, and that a database URL's password never appears."""

from __future__ import annotations

import json
import time
import uuid
from datetime import datetime, timezone

import pytest
import sqlalchemy as sa
from celery import Celery
from celery.schedules import crontab, schedule
from sqlalchemy import exc as sa_exc

from celery_lease.beat.periodic import CRON_GRACE, MAX_CLOCK_SKEW, MAX_TICK_AGE, Periodic, TickRefused
from celery_lease.broker import cancel_notice
from celery_lease.db.engine import Database
from celery_lease.db.refused import refused_value
from celery_lease.db.statements import events, reads
from celery_lease.errors import ConfigurationError, InvalidPayload
from celery_lease.ops import listing
from celery_lease.ops.cli_common import printable
from celery_lease.payload import (
    MAX_JSON_DEPTH,
    Codec,
    UnstorableValue,
    cap_error,
    dump_checkpoint,
    dump_progress,
    storable,
    storable_text,
    too_deep,
)
from celery_lease.settings import Settings
from celery_lease.status import Event

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc).timestamp()


# --- what the job table can store --------------------------------------------------------


@pytest.mark.parametrize(
    "value, says",
    [
        ({"x": "a\x00b"}, "contains a NUL character"),
        ({"a\x00": 1}, "contains a NUL character"),
        (["ok", ["deep", {"k": "\x00"}]], "contains a NUL character"),
        ({"x": "\\\\\x00"}, "contains a NUL character"),  # escaped backslashes, then NUL
        ({"x": "lone \ud800"}, "contains a lone surrogate"),
        ({"\udfff": 1}, "contains a lone surrogate"),
        ({"x": "\ud83d\ude00"}, "contains a lone surrogate"),  # a pair spelt as two code points
        ({"x": object()}, "is not JSON-serializable"),
        ({"x": float("nan")}, "is not JSON-serializable"),
        ({"x": "y" * 100}, "is 108 bytes, over the cap of 50 (lease_max_result_bytes)"),
    ],
)
def test_values_the_table_cannot_store_are_refused_without_quoting_them(value, says):
    with pytest.raises(UnstorableValue) as caught:
        storable(value, "result", 50, "lease_max_result_bytes")
    assert says in str(caught.value)
    assert "\x00" not in str(caught.value) and "yyyy" not in str(caught.value)


def test_storable_values_are_measured_in_utf8_bytes():
    # The six characters backslash-u-0-0-0-0 are text, not NUL; emoji are four bytes.
    assert storable({"x": "\\u0000"}, "payload", 100, "s") == len('{"x":"\\\\u0000"}')
    assert storable({"x": "😀"}, "payload", 100, "s") == len('{"x":""}') + 4


def test_results_are_capped_and_typed_results_checked_too():
    codec = Codec(lambda ctx, payload: payload)
    assert codec.dump_result({"rows": 3}, max_bytes=100) == {"rows": 3}
    with pytest.raises(UnstorableValue, match="over the cap of 10"):
        codec.dump_result({"rows": "x" * 20}, max_bytes=10)
    with pytest.raises(UnstorableValue, match="not JSON-serializable"):
        codec.dump_result({1, 2})


def test_checkpoints_refuse_nul_and_keep_their_size_error():
    with pytest.raises(UnstorableValue, match="checkpoint contains a NUL"):
        dump_checkpoint({"i": "\x00"}, 100)
    with pytest.raises(InvalidPayload):  # UnstorableValue is an InvalidPayload, as before
        dump_checkpoint({"x": object()}, 100)


def _nested(depth: int) -> object:
    value: object = "x"
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


def test_values_nested_deeper_than_the_limit_are_refused_wherever_they_enter():
    """Before: a value 400 levels deep was stored, and every reader whose serializer
    stops sooner (the API's, at 255) failed on its row for good."""
    codec = Codec(lambda ctx, payload: payload)
    assert codec.dump_payload(_nested(MAX_JSON_DEPTH)) == _nested(MAX_JSON_DEPTH)  # at the limit: fine
    for depth in (MAX_JSON_DEPTH + 1, 400, 5000):  # 5000: past Python's own recursion limit
        says = (
            f"levels deep, over the limit of {MAX_JSON_DEPTH}" if depth < 1000 else f"deeper than the limit of {MAX_JSON_DEPTH}"
        )
        for refuse in (
            lambda v: codec.dump_payload(v),
            lambda v: codec.dump_result(v),
            lambda v: dump_progress(v, 10**6),
            lambda v: dump_checkpoint(v, 10**6),
        ):
            with pytest.raises(UnstorableValue, match=says):
                refuse(_nested(depth))
    with pytest.raises(UnstorableValue, match="^payload nests lists and objects 401 levels deep, over the limit of 100$"):
        codec.dump_payload(_nested(401))
    # Brackets in strings and keys are text, not nesting; nor are escaped quotes.
    assert storable({"[" * 300: "{" * 300, "q": '\\"[[[' * 100}, "result", 10**6, "s") > 0
    assert too_deep(_nested(MAX_JSON_DEPTH + 1)) and not too_deep(_nested(MAX_JSON_DEPTH)) and not too_deep(None)


def test_cap_error_survives_nul_and_lone_surrogates():
    """Before, cap_error raised UnicodeEncodeError on a lone surrogate (the job then sat
    running until its lease expired), and NUL went on to fail the UPDATE."""
    assert cap_error("a\x00b \ud800 c") == "a\ufffdb \ufffd c"
    capped = cap_error("\ud800" * 400)
    assert capped == "\ufffd" * 170 and len(capped.encode()) <= 512
    assert cap_error(ValueError("not a str")) == "not a str"


def test_short_text_columns():
    assert storable_text("acme", "tenant", 200) == "acme"
    for value, says in (
        (7, "must be a string, not int"),
        ("x" * 201, "201 characters"),
        ("a\x00", "NUL"),
        ("\udc00", "surrogate"),
    ):
        with pytest.raises(InvalidPayload, match=says):
            storable_text(value, "tenant", 200)


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


def test_result_and_progress_caps_are_settings():
    s = Settings.resolve({"lease_max_result_bytes": "2048"}, {"max_progress_bytes": 512})
    assert (s.max_result_bytes, s.max_progress_bytes) == (2048, 512)
    assert Settings().max_progress_bytes == 64 * 1024 and Settings().max_result_bytes == 1024 * 1024


# --- cancel notices ----------------------------------------------------------------------

ID = "6f1c2c9e-0b0e-4a53-9d6a-3b1f7d2b8c11"


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"not json",
        b'"6f1c2c9e-0b0e-4a53-9d6a-3b1f7d2b8c11"',
        b"{}",
        b"[]",
        json.dumps([ID, 1]).encode(),
        json.dumps([ID, "x" * 36]).encode(),
        json.dumps(["{" + ID[:-2] + "}"]).encode(),
        json.dumps([ID] * (cancel_notice.MAX_IDS + 1)).encode(),
        json.dumps([ID]).encode() + b" " * cancel_notice.MAX_NOTICE_BYTES,
        None,
        12,
    ],
)
def test_malformed_cancel_notices_name_no_job(data):
    assert cancel_notice.parse(data) is None


def test_a_well_formed_notice_names_its_jobs():
    assert cancel_notice.parse(json.dumps([ID.upper(), ID]).encode()) == {ID}
    assert cancel_notice.parse(json.dumps([ID])) == {ID}


def test_a_listener_wakes_only_for_held_jobs_and_at_a_bounded_rate():
    wakes = []
    listener = cancel_notice.Listener(lambda: wakes.append(1), held=lambda: {ID})
    assert not listener.handle(json.dumps([str(uuid.uuid4())]).encode())  # held by nobody here
    assert not listener.handle(b"junk")
    assert wakes == [] and listener.ignored == 2
    started = time.monotonic()
    for _ in range(cancel_notice.WAKE_BURST * 5):
        listener.handle(json.dumps([ID, str(uuid.uuid4())]).encode())
    elapsed = time.monotonic() - started
    # The burst at once, then no more than the rate allows for the time it took.
    assert cancel_notice.WAKE_BURST <= len(wakes) <= cancel_notice.WAKE_BURST + cancel_notice.WAKE_RATE * elapsed + 1
    assert listener.dropped == cancel_notice.WAKE_BURST * 5 - len(wakes)


def test_notice_channels_are_per_app_and_per_database():
    a = cancel_notice.channel("redis://h:6379/0", "shop")
    assert a == "celery-lease:cancelled:0:shop"
    assert cancel_notice.channel("redis://h:6379/3", "shop") != a
    assert cancel_notice.channel("redis://h:6379/0", "other") != a
    assert cancel_notice.channel("redis://h:6379", None) == "celery-lease:cancelled:0:celery"
    assert cancel_notice.channel("redis://h:6379/0?db=0", "a b:c") == "celery-lease:cancelled:0:a_b_c"


# --- beat ticks --------------------------------------------------------------------------


def periodic(every) -> Periodic:
    return Periodic("nightly", kind=None, schedule=every, payload={})  # type: ignore[arg-type]


def test_a_ticks_key_is_derived_from_the_schedule_and_its_time():
    p = periodic(schedule(run_every=60))
    assert p.tick_key(T0 + 30, now=T0 + 45) == "beat:nightly:2026-11-30T12:00:00+00:00"
    # A tick that waited in the queue submits its own slot, within MAX_TICK_AGE.
    assert p.tick_key(T0 + 30, now=T0 + MAX_TICK_AGE) == "beat:nightly:2026-11-30T12:00:00+00:00"
    for tick, now in (
        (T0, T0 + MAX_TICK_AGE + 1),  # too old: its slot is long gone
        (T0 + MAX_CLOCK_SKEW + 1, T0),  # from the future: a slot not due yet
        (float("inf"), T0),
        (True, T0),
        (None, T0),
        ("beat:nightly:2026-11-30T12:00:30+00:00", T0),  # not a slot start
        ("beat:other:2026-11-30T12:00:00+00:00", T0),
        ("beat:nightly:2026-11-30T12:00:00", T0),  # naive
        ("beat:nightly:2099-01-01T00:00:00+00:00", T0),  # a slot start, but years ahead
    ):
        with pytest.raises(TickRefused):
            p.tick_key(tick, now=now)
    # An older beat sent the slot key itself: accepted when it is exactly one.
    assert p.tick_key("beat:nightly:2026-11-30T12:00:00+00:00", now=T0 + 10) == "beat:nightly:2026-11-30T12:00:00+00:00"


def test_a_crontab_tick_must_fall_when_the_crontab_fires():
    p = periodic(crontab(minute="0", hour="12", app=Celery(set_as_current=False)))
    assert p.tick_key(T0 + 5, now=T0 + 5).endswith("T12:00:00+00:00")
    assert p.tick_key(T0 + 60 * CRON_GRACE, now=T0 + 60 * CRON_GRACE)  # a late beat
    with pytest.raises(TickRefused, match="crontab does not fire"):
        p.tick_key(T0 + 60 * (CRON_GRACE + 1), now=T0 + 60 * (CRON_GRACE + 1))
    with pytest.raises(TickRefused, match="crontab does not fire"):
        p.tick_key(T0 - 3600, now=T0 - 3600)


# --- the API reads only what it shows ----------------------------------------------------


def _selected(stmt) -> list[str]:
    return [c.name for c in stmt.selected_columns]


def test_the_api_statements_read_only_the_columns_it_shows():
    # One job's route shows its attempts too (the worker of each: a node name, no pid).
    assert _selected(reads.get_job_view(ID)) == [*listing.API_FIELDS, "attempts"]
    summaries = reads.list_job_summaries(max_value_bytes=1024, tenant="acme", limit=10)
    assert set(_selected(summaries)) == set(listing.API_FIELDS) | {"result_bytes", "progress_bytes"}
    for stmt in (reads.get_job_view(ID, tenant="acme"), summaries):
        assert not {"payload", "checkpoint", "lease_owner"} & set(_selected(stmt))
    # The tenant is in the WHERE clause of a get: another tenant's job reads like a missing one.
    where = str(reads.get_job_view(ID, tenant="acme").whereclause)
    assert "celery_lease_jobs_all.tenant = " in where and "celery_lease_jobs_all.id = " in where
    assert "tenant" not in str(reads.get_job_view(ID).whereclause)


def test_views_and_tenant_events_on_sqlite(store, add_job):
    run = str(uuid.uuid4())
    mine = add_job(tenant="acme", run_id=run, payload={"secret": 1})
    theirs = add_job(tenant="globex", run_id=run)
    view = store.get_view(mine, tenant="acme")
    assert view is not None and set(view) == {*listing.API_FIELDS, "attempts"} and view["created_at"].tzinfo is not None
    assert store.get_view(theirs, tenant="acme") is None and store.get_view(theirs) is not None
    assert store.run_visible(run, tenant="acme") and not store.run_visible(run, tenant="initech")
    with store.durable.begin() as conn:
        for job in (theirs, mine, theirs, mine):
            conn.execute(events.append_events(), [events.event_row(run, job, Event.CLAIMED, 1, "host/1/boot")])
    seqs = [(e["seq"], e["job_id"]) for e in store.tenant_run_events(run, "acme")]
    assert seqs == [(1, mine), (2, mine)]
    assert [e["seq"] for e in store.tenant_run_events(run, "acme", after_seq=1)] == [2]


def test_cursors_are_read_in_utc():
    def cursor(created: str) -> str:
        return listing.encode_cursor({"created_at": datetime.fromisoformat(created), "id": ID})

    created, _ = listing.decode_cursor(cursor("2026-01-01T14:00:00+02:00"))
    assert created == datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc) and created.utcoffset().total_seconds() == 0
    import base64

    for text in ("0001-01-01T00:00:00+05:00", "9999-12-31T23:59:59-05:00"):
        token = base64.urlsafe_b64encode(json.dumps([text, ID]).encode()).decode().rstrip("=")
        with pytest.raises(ValueError, match="malformed cursor"):
            listing.decode_cursor(token)


# --- the terminal, and credentials ---------------------------------------------------------


def test_printable_escapes_what_a_terminal_would_act_on():
    assert printable("ok é 😀 \\ path") == "ok é 😀 \\ path"
    assert printable("\x1b[2J\x07\r\n\t\x9b\u202e\u2066\ud800") == "\\x1b[2J\\x07\\r\\n\\t\\x9b\\u202e\\u2066\\ud800"


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


def test_api_fields_match_the_view_columns():
    assert [c.name for c in reads.VIEW_COLUMNS] == list(listing.API_FIELDS)
    assert isinstance(reads.run_visible(ID), sa.Select)


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
