"""What ``@leases.job`` declares about flow control, checked when the decorator runs.

Plain values (no database, no Celery) so the registry, the producer and the worker can
all hold them::

    @leases.job(kind="sync", concurrency=2)
    @leases.job(kind="fetch", concurrency=1, concurrency_key=lambda payload: payload["tenant"])
    @leases.job(kind="call_api", rate_limit="20/s")          # "/s", "/m", "/h"

A mistake (``concurrency=0``, ``rate_limit="20 per second"``, a key function without a
concurrency) raises ValueError at import, not at the first claim. How the limits are
enforced is :mod:`celery_lease.flow`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

from celery_lease.errors import InvalidPayload

#: The width of the concurrency_key column.
MAX_KEY_CHARS = 255
#: Priorities are 0 (the default, lowest) up to this (Celery's range); higher is claimed first.
MAX_PRIORITY = 255

_UNITS = {"s": 1, "m": 60, "h": 3600}
_RATE = re.compile(r"^\s*(\d+)\s*/\s*([smh])\s*$")


@dataclasses.dataclass(frozen=True)
class Rate:
    """At most ``count`` claims in each window of ``per_seconds`` (database clock,
    windows aligned to the epoch), over every worker."""

    count: int
    per_seconds: int

    @classmethod
    def parse(cls, text: str) -> Rate:
        match = _RATE.match(text) if isinstance(text, str) else None
        if match is None:
            raise ValueError(f"rate_limit must look like '20/s', '100/m' or '1000/h', not {str(text)[:40]!r}")
        count = int(match.group(1))
        if count < 1:
            raise ValueError(f"rate_limit must allow at least one claim per window, not {text!r}")
        return cls(count, _UNITS[match.group(2)])

    def __str__(self) -> str:
        unit = {v: k for k, v in _UNITS.items()}[self.per_seconds]
        return f"{self.count}/{unit}"


@dataclasses.dataclass(frozen=True)
class Limits:
    #: Jobs of the kind (of one key, with ``concurrency_key``) running at once, fleet-wide.
    concurrency: int | None = None
    #: payload -> key; jobs are counted per key. Called at submit with the payload as
    #: stored (JSON: a dataclass or pydantic payload arrives as a dict).
    concurrency_key: Callable[[Any], Any] | None = None
    rate: Rate | None = None

    @classmethod
    def declare(
        cls, concurrency: int | None, concurrency_key: Callable[[Any], Any] | None, rate_limit: str | None
    ) -> Limits | None:
        """The limits of a kind, or None when it declares none (it then pays nothing)."""
        if concurrency is not None and (isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1):
            raise ValueError(f"concurrency must be a whole number of jobs, at least 1, not {concurrency!r}")
        if concurrency_key is not None:
            if not callable(concurrency_key):
                raise ValueError("concurrency_key must be a function of the payload, e.g. lambda payload: payload['tenant']")
            if concurrency is None:
                raise ValueError("concurrency_key needs concurrency=N: the number of jobs of one key that may run at once")
        rate = None if rate_limit is None else Rate.parse(rate_limit)
        if concurrency is None and rate is None:
            return None
        return cls(concurrency=concurrency, concurrency_key=concurrency_key, rate=rate)

    def key_for(self, kind: str, payload: Any) -> str | None:
        """The concurrency key of a payload (at submit); InvalidPayload when the key
        function fails or returns something that is not a short string or number."""
        if self.concurrency_key is None:
            return None
        try:
            key = self.concurrency_key(payload)
        except Exception as exc:
            # The key function is the application's; its message may quote the payload.
            raise InvalidPayload(f"concurrency_key of kind {kind!r} raised {type(exc).__name__}") from None
        if key is None:
            return None
        if isinstance(key, bool) or not isinstance(key, (str, int)):
            raise InvalidPayload(f"concurrency_key of kind {kind!r} must return a string or an integer, not {type(key).__name__}")
        key = str(key)
        if len(key) > MAX_KEY_CHARS:
            raise InvalidPayload(f"concurrency_key of kind {kind!r} is longer than {MAX_KEY_CHARS} characters")
        return key


def parse_priority(value: Any) -> int:
    """A submit's priority: a whole number from 0 (the default) to MAX_PRIORITY."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_PRIORITY:
        raise InvalidPayload(f"priority must be a whole number from 0 to {MAX_PRIORITY}, not {str(value)[:40]!r}")
    return value
