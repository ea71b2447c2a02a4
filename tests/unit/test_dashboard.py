"""The dashboard's pure parts: sessions and CSRF tokens, filters, the live figures and
a job's attempts (no services; the pages are tested in tests/e2e/test_dashboard.py)."""

from __future__ import annotations

import hashlib
from datetime import datetime, timedelta, timezone

import pytest
import sqlalchemy as sa

from celery_lease.db import schema
from celery_lease.db.dashboard_store import DashboardStore
from celery_lease.ops.dashboard import filters
from celery_lease.ops.dashboard.access import Sessions, csrf_ok
from celery_lease.ops.dashboard.fleet import live_figures, percentile
from celery_lease.ops.dashboard.pages import attempts_of
from celery_lease.ops.tokens import Grant, Keyring

ADMIN, ACME, READER = "admin-token-0123456789", "acme-token-0123456789ab", "reader-token-0123456789"
TOKENS = {ADMIN: Grant(None), ACME: Grant("acme"), READER: Grant(None, read_only=True)}


def _sessions(store, tokens=TOKENS, secret: bytes = b"k" * 32) -> Sessions:
    return Sessions(Keyring(tokens, secret), DashboardStore(store), secret)


def test_a_session_names_its_token_grant_and_nothing_forged_passes(store):
    sessions = _sessions(store)
    assert sessions.sign_in("nope") is None
    assert sessions.sign_in("") is None
    assert sessions.sign_in(ACME[:-1]) is None
    cookie = sessions.sign_in(ACME)
    assert cookie is not None and ACME not in cookie  # the cookie never carries the token
    viewer = sessions.viewer(cookie)
    assert viewer is not None and viewer.tenant == "acme" and viewer.can_act
    assert not sessions.viewer(sessions.sign_in(READER)).can_act
    data, signature = cookie.split(".")
    other = "BB" if data.endswith("AA") else "AA"  # (a random session may end in "AA": seen once)
    for forged in (f"{data}.{signature[:-2]}xx", f"{data[:-2]}{other}.{signature}", data, "", "a.b.c", "x" * 1000):
        assert sessions.viewer(forged) is None
    # Another key (another server without the shared secret) does not accept it.
    assert _sessions(store, secret=b"j" * 32).viewer(cookie) is None
    # A token removed from the configuration ends its sessions.
    assert _sessions(store, tokens={ADMIN: Grant(None)}).viewer(cookie) is None
    # Sessions expire (the database's clock).
    with store.durable.begin() as conn:
        conn.execute(sa.update(schema.sessions).values(expires_at=datetime.now(timezone.utc) - timedelta(seconds=1)))
    assert sessions.viewer(cookie) is None


def test_the_cookie_is_random_and_keyed_never_derived_from_the_token(store):
    """Before: the cookie carried sha256(token)[:32], which a leaked cookie lets anyone
    test guesses against offline. Now: a random id and its HMAC under the secret; the
    row holds keyed hashes only."""
    sessions = _sessions(store)
    one, two = sessions.sign_in(ADMIN), sessions.sign_in(ADMIN)
    assert one != two
    unkeyed = hashlib.sha256(ADMIN.encode()).hexdigest()
    with store.durable.connect() as conn:
        rows = [tuple(r) for r in conn.execute(sa.select(schema.sessions.c.id, schema.sessions.c.token))]
    stored = " ".join(v for r in rows for v in r)
    for value in (one, two, stored):
        assert ADMIN not in value and unkeyed[:16] not in value
    assert one.split(".")[0] not in stored  # the row names the session by a keyed hash


def test_signing_out_ends_the_session_everywhere(store):
    """Before: sign-out deleted the browser's cookie only; a copy kept working for 12 h."""
    sessions, other_process = _sessions(store), _sessions(store)
    cookie = sessions.sign_in(ADMIN)
    assert other_process.viewer(cookie) is not None
    other_process.sign_out(cookie)
    assert sessions.viewer(cookie) is None and other_process.viewer(cookie) is None
    assert sessions.viewer(sessions.sign_in(ADMIN)) is not None  # a new sign-in works


def test_a_token_keeps_its_newest_sessions_and_a_non_ascii_cookie_is_none(store):
    from celery_lease.ops.dashboard import access

    sessions = _sessions(store)
    cookies = [sessions.sign_in(ADMIN) for _ in range(access.MAX_SESSIONS_PER_TOKEN + 3)]
    acme = sessions.sign_in(ACME)
    # SQLite's clock has milliseconds: which of sessions opened in one are "oldest" is
    # any (tests/integration/test_api_security.py checks the order on PostgreSQL).
    live = [sessions.viewer(c) is not None for c in cookies]
    assert live.count(True) == access.MAX_SESSIONS_PER_TOKEN and live[-1]
    assert sessions.viewer(acme) is not None  # another token's are its own
    session, signature = cookies[-1].split(".")
    for odd in (f"{session}.{signature[:-1]}\u00e9", f"{session}\u00ff.{signature}", "\u00e9.\u00e9"):
        assert sessions.viewer(odd) is None
        sessions.sign_out(odd)  # nothing to end, no error
    assert sessions.viewer(cookies[-1]) is not None


def test_csrf_tokens_belong_to_one_session(store):
    sessions = _sessions(store)
    one, two = sessions.viewer(sessions.sign_in(ADMIN)), sessions.viewer(sessions.sign_in(ADMIN))
    assert one.csrf != two.csrf
    assert csrf_ok(one, one.csrf)
    assert not csrf_ok(one, two.csrf)
    assert not csrf_ok(one, None)
    assert not csrf_ok(one, "")


def test_filters_are_checked_where_they_enter():
    params = {"status": "failed", "kind": "load", "since": "2026-12-01T13:05", "field": "table", "value": "t7"}
    f = filters.parse(params, tenant=None, payloads=True)
    assert (f.status, f.kind, f.field, f.value) == ("failed", "load", "table", "t7")
    assert f.since == datetime(2026, 12, 1, 13, 5, tzinfo=timezone.utc)
    # Empty fields (an HTML form sends them all) are absent.
    assert filters.parse({"status": "", "kind": "", "run": ""}, tenant=None, payloads=True) == filters.Filter()
    # A tenant viewer's filter is its own tenant, whatever it asks for.
    assert filters.parse({"tenant": "globex"}, tenant="acme", payloads=True).tenant == "acme"
    for bad, message in (
        ({"stauts": "failed"}, "unknown filter"),
        ({"status": "done"}, "unknown status"),
        ({"run": "not-a-uuid"}, "run"),
        ({"since": "yesterday"}, "not a time"),
        ({"field": "a b", "value": "1"}, "payload field"),
        ({"field": "table"}, "both a field and a value"),
        ({"kind": "x\x00"}, "NUL"),
        ({"queue": "q" * 500}, "at most"),
    ):
        with pytest.raises(ValueError, match=message):
            filters.parse(bad, tenant=None, payloads=True)
    # Finding jobs by a payload value reveals it: only for tokens that may read payloads.
    with pytest.raises(ValueError, match="may not read payloads"):
        filters.parse({"field": "table", "value": "t7"}, tenant=None, payloads=False)
    assert filters.parse({"kind": "load"}, tenant=None, payloads=False).kind == "load"
    # Links rebuild the filter with its values escaped: an & in a kind stays data.
    f = filters.parse({"kind": "a&b=c", "status": "failed"}, tenant=None, payloads=True)
    assert "kind=a%26b%3Dc" in filters.query_string(f)


def test_percentiles_are_nearest_rank():
    assert percentile([], 50) is None
    assert percentile([3.0], 95) == 3.0
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 95) == 95.0
    assert percentile(list(reversed(values)), 95) == 95.0


def test_live_figures_count_each_minute_and_the_window_latencies():
    now = datetime(2026, 12, 1, 14, 0, 30, tzinfo=timezone.utc)
    minute = int(now.timestamp() // 60)
    data = {
        "now": now,
        "minute": minute,
        "submits": [("load", minute, 4), ("load", minute - 2, 1), ("load", minute - 99, 7)],  # the last: out of the window
        "finishes": [
            ("load", "succeeded", minute, 1.0, 10.0),
            ("load", "succeeded", minute, 3.0, 30.0),
            ("load", "failed", minute - 1, 2.0, 20.0),
            ("load", "cancelled", minute, None, None),  # never started: no latency
        ],
    }
    out = live_figures(data, minutes=3)
    assert out["minutes"] == ["13:58", "13:59", "14:00"]
    (load,) = out["kinds"]
    assert (load["submitted"], load["succeeded"], load["failed"]) == ([1, 0, 4], [0, 0, 2], [0, 1, 0])
    assert (load["wait_p50"], load["wait_p95"], load["run_p50"], load["run_p95"]) == (2.0, 3.0, 20.0, 30.0)
    assert not out["capped"]


def _event(event: str, attempt: int, detail=None, at: int = 0) -> dict:
    return {"event": event, "attempt": attempt, "detail": detail, "created_at": datetime(2026, 1, 1) + timedelta(seconds=at)}


def test_attempts_come_from_the_run_events():
    job = {"attempt": 3, "status": "succeeded", "lease_owner": None, "started_at": None, "finished_at": None, "lease_losses": 1}
    events = [
        _event("dispatched", 0),
        _event("claimed", 1, "w1/10/b1", 1),
        _event("dispatched", 1, None, 1),  # not an ending, whatever its attempt
        _event("retried", 1, "internal error", 2),
        _event("claimed", 2, "w2/20/b2", 3),
        _event("reaped", 2, "lease expired: pending", 9),
        _event("claimed", 3, "w1/11/b1", 10),
        _event("succeeded", 3, None, 12),
    ]
    attempts = attempts_of(job, events, show_worker=True)
    assert [(a["attempt"], a["worker"], a["outcome"], a["lease_losses"]) for a in attempts] == [
        (1, "w1/10/b1", "retried", 0),
        (2, "w2/20/b2", "reaped", 1),
        (3, "w1/11/b1", "succeeded", 0),
    ]
    assert all(a["worker"] is None for a in attempts_of(job, events, show_worker=False))
    # A job outside a run has no events: its row tells the current attempt.
    row = {**job, "lease_owner": "w3/1/b", "status": "running"}
    assert [(a["attempt"], a["worker"], a["outcome"]) for a in attempts_of(row, [], show_worker=True)] == [
        (3, "w3/1/b", "running")
    ]


def test_the_signing_key_comes_from_the_settings_or_is_drawn_per_process(monkeypatch):
    from celery_lease.errors import ConfigurationError
    from celery_lease.ops.tokens import load_secret

    monkeypatch.delenv("CELERY_LEASE_DASHBOARD_SECRET", raising=False)
    assert load_secret({"lease_dashboard_secret": "s" * 16}) == b"s" * 16
    monkeypatch.setenv("CELERY_LEASE_DASHBOARD_SECRET", "e" * 20)
    assert load_secret({}) == b"e" * 20
    monkeypatch.delenv("CELERY_LEASE_DASHBOARD_SECRET")
    drawn = load_secret({})
    assert len(drawn) == 32 and drawn != load_secret({})  # random: sessions end with the process
    for bad in ("short", 12345):
        with pytest.raises(ConfigurationError, match="lease_dashboard_secret"):
            load_secret({"lease_dashboard_secret": bad})
