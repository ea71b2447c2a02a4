"""Request rates of the HTTP API and the dashboard, token buckets in the serve process.

:class:`Gate` holds them all. A signed-in token (API bearer or dashboard session: one
bucket) may make ``lease_api_rate`` requests a second, in bursts of twice that. Failed
authentications spend a budget of the client address and one over all addresses; once
either is spent, a token offered from there is answered 429 unread, right or wrong,
except from addresses that authenticated within RECENT_SECONDS. So no set of addresses
guesses faster than FAILED_OVERALL a second, and known users are not locked out; a
request without a token costs nothing. Sign-ins are limited per address too
(SIGN_INS_PER_ADDRESS); an IPv6 address counts as its /64. Over a budget: 429 with
``Retry-After``, nothing read. Buckets are per process: N processes, N times the rate.
"""

from __future__ import annotations

import ipaddress
import math
import threading
import time
from collections import OrderedDict

#: Buckets kept at most; the least recently used are dropped first (a dropped bucket
#: is full again, which is why failures are also counted over all addresses).
MAX_BUCKETS = 10_000
#: Failed authentications a second from one client address (bursts of twice as many).
FAILED_PER_ADDRESS = 5.0
#: Failed authentications a second from all addresses together. While it is spent,
#: every token offered (sign-ins and API bearer tokens, right or wrong) is answered
#: 429 unread: a flood of guesses from many addresses holds off token users for as
#: long as it lasts (signed-in dashboard sessions carry no token and are unaffected).
#: One address alone cannot spend it: its own budget locks it first.
FAILED_OVERALL = 20.0
#: Successful sign-ins a minute from one client address, in bursts of as many: a person
#: signs in a few times a day; an office behind one address still gets 30 a minute.
SIGN_INS_PER_ADDRESS = 30
#: How long a right token from an address lets that address past a spent global
#: failure budget (a dashboard session's lifetime).
RECENT_SECONDS = 12 * 3600.0


def client_key(address: str) -> str:
    """The budget an address spends: an IPv6 address's /64 (an IPv4 one mapped into
    IPv6 is the IPv4 address), anything else as it is."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class Throttle:
    def __init__(self, rate: float, burst: float | None = None) -> None:
        #: Requests a second per token; 0 (or less) turns the throttle off.
        self.rate = rate
        #: Requests at once (a full bucket); by default twice the rate.
        self.burst = max(1.0, 2 * rate if burst is None else burst)
        self._lock = threading.Lock()
        self._buckets: dict[str, tuple[float, float]] = {}  # token -> (tokens, at)

    def wait(self, key: str, *, count: bool = True) -> float:
        """0 when ``key`` may make a request now (and, with ``count``, counts it),
        else the seconds until it may."""
        if self.rate <= 0:
            return 0.0
        now = time.monotonic()
        with self._lock:
            tokens, at = self._buckets.pop(key, (self.burst, now))
            tokens = min(self.burst, tokens + (now - at) * self.rate)
            if len(self._buckets) >= MAX_BUCKETS:
                self._buckets.pop(next(iter(self._buckets)))
            if tokens >= 1.0:
                self._buckets[key] = (tokens - 1.0 if count else tokens, now)
                return 0.0
            self._buckets[key] = (tokens, now)
            return (1.0 - tokens) / self.rate


class Gate:
    """Every rate of the serve process (see the module's docstring)."""

    def __init__(self, rate: float) -> None:
        self._requests = Throttle(rate)
        self._failed_here = Throttle(FAILED_PER_ADDRESS)
        self._failed_anywhere = Throttle(FAILED_OVERALL)
        self._sign_ins = Throttle(SIGN_INS_PER_ADDRESS / 60.0, burst=SIGN_INS_PER_ADDRESS)
        self._lock = threading.Lock()
        #: client key -> when it last offered a right token (monotonic), oldest first.
        self._known: OrderedDict[str, float] = OrderedDict()

    def _recent(self, key: str) -> bool:
        with self._lock:
            at = self._known.get(key)
            return at is not None and time.monotonic() - at < RECENT_SECONDS

    def locked(self, address: str) -> float:
        """Seconds until ``address`` may try a token again (0: now). Counts nothing:
        only a failure does (:meth:`attempted`)."""
        key = client_key(address)
        here = self._failed_here.wait(key, count=False)
        if self._recent(key):
            return here
        return max(here, self._failed_anywhere.wait("", count=False))

    def failed(self, address: str) -> None:
        """Count a failed authentication from ``address``."""
        self._failed_here.wait(client_key(address))
        self._failed_anywhere.wait("")

    def attempted(self, address: str, right: bool) -> None:
        """Count an authentication from ``address``: a failure, or a right token that
        lets the address past a spent global budget for RECENT_SECONDS."""
        if not right:
            self.failed(address)
            return
        key = client_key(address)
        with self._lock:
            self._known.pop(key, None)
            self._known[key] = time.monotonic()
            if len(self._known) > MAX_BUCKETS:
                self._known.popitem(last=False)

    def sign_ins_wait(self, address: str) -> float:
        """Seconds until ``address`` may sign in again (0: now); counts nothing."""
        return self._sign_ins.wait(client_key(address), count=False)

    def signed_in(self, address: str) -> float:
        """0 when ``address`` may open a session now (counted, and the address is known
        for RECENT_SECONDS), else the seconds until it may (nothing counted)."""
        wait = self._sign_ins.wait(client_key(address))
        if not wait:
            self.attempted(address, True)
        return wait

    def admit(self, ident: str) -> float:
        """0 when the token ``ident`` (Holder.ident) may make a request now (counted),
        else the seconds until it may."""
        return self._requests.wait(ident)


def retry_after(seconds: float) -> str:
    """The Retry-After header's value: whole seconds, at least 1."""
    return str(max(1, math.ceil(seconds)))
