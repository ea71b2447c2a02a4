"""Per-token request rate of the HTTP API: a token bucket for each bearer token.

A token may make ``rate`` requests a second on average, in bursts of up to ``2 * rate``;
a request over that is answered 429 with ``Retry-After`` (whole seconds until the
bucket holds a request again) and reads nothing. The buckets live in the API process:
with N API processes behind a balancer a token gets up to N times the rate.
"""

from __future__ import annotations

import math
import threading
import time

#: Buckets kept at most; the fullest (least recently used) are dropped first. Keys are
#: configured tokens only, so this bounds nothing an anonymous caller controls.
MAX_BUCKETS = 10_000


class Throttle:
    def __init__(self, rate: float) -> None:
        #: Requests a second per token; 0 (or less) turns the throttle off.
        self.rate = rate
        self.burst = max(1.0, 2 * rate)
        self._lock = threading.Lock()
        self._buckets: dict[str, tuple[float, float]] = {}  # token -> (tokens, at)

    def wait(self, key: str) -> float:
        """0 when ``key`` may make a request now (and counts it), else the seconds
        until it may."""
        if self.rate <= 0:
            return 0.0
        now = time.monotonic()
        with self._lock:
            tokens, at = self._buckets.pop(key, (self.burst, now))
            tokens = min(self.burst, tokens + (now - at) * self.rate)
            if len(self._buckets) >= MAX_BUCKETS:
                self._buckets.pop(next(iter(self._buckets)))
            if tokens >= 1.0:
                self._buckets[key] = (tokens - 1.0, now)
                return 0.0
            self._buckets[key] = (tokens, now)
            return (1.0 - tokens) / self.rate


def retry_after(seconds: float) -> str:
    """The Retry-After header's value: whole seconds, at least 1."""
    return str(max(1, math.ceil(seconds)))
