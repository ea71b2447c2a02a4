"""ops' security rules, without services (issue 19): the throttle's arithmetic, metrics
key labels, tokens and scrape tokens."""

from __future__ import annotations

import pytest

from celery_lease.ops import throttle
from celery_lease.ops.metrics import key_series
from celery_lease.ops.tokens import Grant, scrape_tokens


def test_a_token_gets_its_burst_then_its_rate(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(throttle.time, "monotonic", lambda: now[0])
    gate = throttle.Throttle(rate=2)
    assert [gate.wait("a") for _ in range(4)] == [0.0] * 4  # a burst of twice the rate
    assert gate.wait("a") == pytest.approx(0.5)  # one request comes back in 1/rate s
    assert gate.wait("b") == 0.0  # another token has its own bucket
    now[0] += 0.5
    assert gate.wait("a") == 0.0
    assert throttle.retry_after(0.01) == "1" and throttle.retry_after(2.2) == "3"
    assert all(throttle.Throttle(rate=0).wait("a") == 0.0 for _ in range(100))  # off


def test_metrics_label_only_the_busiest_keys_and_only_when_asked():
    def row(kind, key, running):
        return {"kind": kind, "key": key, "running": running, "waiting_limit": 1, "waiting_rate": 0, "waiting_pause": 0}

    rows = [row("fetch", "acme", 5), row("fetch", "globex", 1), row("fetch", "initech", 3), row("sync", None, 2)]
    assert set(key_series(rows, 0)) == {("fetch", "other"), ("sync", "")}
    assert key_series(rows, 0)[("fetch", "other")]["running"] == 9
    two = key_series(rows, 2)
    assert set(two) == {("fetch", "acme"), ("fetch", "initech"), ("fetch", "other"), ("sync", "")}
    assert two[("fetch", "other")] == {"running": 1, "waiting_limit": 1, "waiting_rate": 0, "waiting_pause": 0}


def test_metrics_close_as_soon_as_any_token_is_configured():
    assert scrape_tokens({}, None) is None  # nothing configured: open
    assert scrape_tokens({"t": Grant("acme")}, None) == []  # only tenant tokens: nobody scrapes
    assert scrape_tokens({"t": Grant("acme"), "o": Grant(None)}, "m") == ["m", "o"]


# --- issue 28 ----------------------------------------------------------------------------


def test_failed_authentications_lock_an_address_then_everyone(monkeypatch):
    """Before: a wrong bearer token cost nothing, and the sign-in form counted per address
    only: rotating addresses guessed without limit."""
    now = [100.0]
    monkeypatch.setattr(throttle.time, "monotonic", lambda: now[0])
    gate = throttle.Gate(rate=0)
    burst = int(2 * throttle.FAILED_PER_ADDRESS)
    for _ in range(burst):
        assert gate.locked("10.0.0.1") == 0.0  # looking counts nothing
        gate.failed("10.0.0.1")
    assert gate.locked("10.0.0.1") > 0 and gate.locked("10.0.0.2") == 0.0
    # Many addresses, each within its own budget, spend the global one.
    for i in range(int(2 * throttle.FAILED_OVERALL)):
        gate.failed(f"10.1.{i // 250}.{i % 250}")
    assert gate.locked("10.0.0.3") > 0
    now[0] += 1.0
    assert gate.locked("10.0.0.3") == 0.0  # it refills at FAILED_OVERALL a second
    assert gate.admit("any") == 0.0  # rate 0: signed-in requests unlimited


def test_short_tokens_are_refused_where_configured_and_where_offered():
    """Before: a one-character token was accepted."""
    from celery_lease.errors import ConfigurationError
    from celery_lease.ops.tokens import MIN_TOKEN_CHARS, Keyring, load_metrics_token, load_tokens

    short = "x" * (MIN_TOKEN_CHARS - 1)
    for conf in ({"lease_api_tokens": {"a": None}}, {"lease_api_tokens": {short: None, "y" * 40: "acme"}}):
        with pytest.raises(ConfigurationError, match=f"1 token\\(s\\) shorter than {MIN_TOKEN_CHARS}") as caught:
            load_tokens(conf)
        assert short not in str(caught.value)  # the message names no token
    with pytest.raises(ConfigurationError, match="lease_metrics_token must be a string of at least"):
        load_metrics_token({"lease_metrics_token": "m"})
    ring = Keyring({"z" * MIN_TOKEN_CHARS: Grant(None)}, b"k" * 32)
    assert ring.find("z" * MIN_TOKEN_CHARS) is not None
    assert ring.find("z" * (MIN_TOKEN_CHARS - 1)) is None and ring.find("") is None


def test_payloads_are_for_unrestricted_tokens_unless_said_otherwise():
    from celery_lease.ops.tokens import _grant

    assert Grant(None).sees_payloads
    assert not Grant("acme").sees_payloads and not Grant(None, read_only=True).sees_payloads
    assert _grant({"tenant": "acme", "payloads": True}).sees_payloads
    assert not _grant({"tenant": None, "payloads": False}).sees_payloads


def test_a_client_address_budget_is_an_ipv6_64_and_known_addresses_pass_a_global_lockout(monkeypatch):
    assert throttle.client_key("2001:db8:1:2:aaaa::1") == throttle.client_key("2001:DB8:1:2::ffff") == "2001:db8:1:2::/64"
    assert throttle.client_key("2001:db8:1:3::1") == "2001:db8:1:3::/64"
    assert throttle.client_key("::ffff:192.0.2.7") == "192.0.2.7" and throttle.client_key("192.0.2.7") == "192.0.2.7"
    assert throttle.client_key("testclient") == "testclient"  # not an address: as it is
    now = [100.0]
    monkeypatch.setattr(throttle.time, "monotonic", lambda: now[0])
    gate = throttle.Gate(rate=0)
    gate.attempted("192.0.2.1", True)  # a right token from here

    def flood() -> None:  # the global budget, spent from ever new addresses
        for i in range(int(2 * throttle.FAILED_OVERALL)):
            gate.attempted(f"198.51.100.{i}", False)

    flood()
    assert gate.locked("203.0.113.9") > 0  # a stranger waits
    assert gate.locked("192.0.2.1") == 0  # a known address does not...
    now[0] += throttle.RECENT_SECONDS
    flood()
    assert gate.locked("192.0.2.1") > 0  # ...for ever
    # Successful sign-ins: a burst of SIGN_INS_PER_ADDRESS a minute, per address.
    assert all(gate.signed_in("192.0.2.5") == 0 for _ in range(throttle.SIGN_INS_PER_ADDRESS))
    assert gate.sign_ins_wait("192.0.2.5") == pytest.approx(60 / throttle.SIGN_INS_PER_ADDRESS)
    assert gate.signed_in("192.0.2.5") > 0 and gate.sign_ins_wait("192.0.2.6") == 0
