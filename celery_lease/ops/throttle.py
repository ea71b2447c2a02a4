"""Request rates of the HTTP API and the dashboard, token buckets in the serve process.

:class:`Gate` holds them all. A signed-in token (a bearer token on the API, a session on
the dashboard: the same bucket for both) may make ``lease_api_rate`` requests a second
on average, in bursts of up to twice that. Failed authentications (an unknown bearer
token on the API or /metrics, an unknown token on the sign-in form) are counted per
client address and over all addresses together: once either budget is spent, every
attempt from that address (or, for the global one, from anywhere) is answered 429
before its token is even compared, right or wrong, so neither one address nor many
rotating ones can guess faster than FAILED_OVERALL a second. A request without any
token is no guess and costs nothing.

Over a budget a request is answered 429 with ``Retry-After`` (whole seconds until the
bucket holds a request again) and reads nothing. The buckets live in the serve
process: with N processes behind a balancer a token gets up to N times the rate.
The client address is the peer's, or behind a proxy trusted with ``serve
--proxy-headers`` the one it forwards: behind an untrusted proxy every client shares
the proxy's budget.
"""

from __future__ import annotations

import math
import threading
import time

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


class Throttle:
    def __init__(self, rate: float) -> None:
        #: Requests a second per token; 0 (or less) turns the throttle off.
        self.rate = rate
        self.burst = max(1.0, 2 * rate)
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

    def locked(self, address: str) -> float:
        """Seconds until ``address`` may try a token again (0: now). Counts nothing:
        only a failure does (:meth:`failed`)."""
        return max(self._failed_here.wait(address, count=False), self._failed_anywhere.wait("", count=False))

    def failed(self, address: str) -> None:
        """Count a failed authentication from ``address``."""
        self._failed_here.wait(address)
        self._failed_anywhere.wait("")

    def admit(self, ident: str) -> float:
        """0 when the token ``ident`` (Holder.ident) may make a request now (counted),
        else the seconds until it may."""
        return self._requests.wait(ident)


def retry_after(seconds: float) -> str:
    """The Retry-After header's value: whole seconds, at least 1."""
    return str(max(1, math.ceil(seconds)))
