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


# --- an operator's override (celery lease limit, PUT /api/v1/kinds/{kind}/limits, the dashboard)

#: Back to what the code declares (the override is removed).
DEFAULT = "default"
#: Explicitly no limit, whatever the code declares.
NO_LIMIT = "none"
#: The largest concurrency or rate count an override takes (the columns are 32-bit).
MAX_LIMIT = 1_000_000

Setting = str  # DEFAULT or NO_LIMIT


@dataclasses.dataclass(frozen=True)
class LimitChange:
    """What an operator changes of a kind's limits, for the whole fleet. Each of
    ``concurrency`` and ``rate`` is None (left as it is), DEFAULT (the override
    removed: what the code declares binds again), NO_LIMIT (no limit whatever the code
    declares), or the new limit. Stored as the limits row's ``*_override`` columns."""

    concurrency: int | Setting | None = None
    rate: Rate | Setting | None = None

    @classmethod
    def parse(cls, *, concurrency: Any = None, rate: Any = None, given: tuple[bool, bool] = (True, True)) -> LimitChange:
        """From the CLI's text or the API's JSON: ``given`` says which of the two were
        given at all (a value None that was given means NO_LIMIT: JSON null, the API's
        "no limit"). ValueError with what is wrong, for the caller to show."""
        if not any(given):
            raise ValueError("nothing to change: give a concurrency, a rate limit, or both")
        return cls(
            concurrency=_parse_concurrency(concurrency) if given[0] else None,
            rate=_parse_rate(rate) if given[1] else None,
        )

    def params(self) -> dict[str, Any]:
        """The bind parameters of override_limits (0: no limit, NULL: the default)."""
        r = self.rate
        return {
            "set_concurrency": self.concurrency is not None,
            "concurrency_override": _stored(self.concurrency),
            "set_rate": r is not None,
            "rate_override": _stored(r.count if isinstance(r, Rate) else r),
            "per_seconds_override": r.per_seconds if isinstance(r, Rate) else None,
        }


def _stored(value: int | Setting | None) -> int | None:
    """An override column's value: NULL for DEFAULT (or unchanged), 0 for NO_LIMIT, else N."""
    if value == NO_LIMIT:
        return 0
    return None if value == DEFAULT else value  # type: ignore[return-value]


def _setting(value: Any) -> Setting | None:
    if value is None:
        return NO_LIMIT
    if isinstance(value, str) and value.strip().lower() in (DEFAULT, NO_LIMIT):
        return value.strip().lower()
    return None


def _parse_concurrency(value: Any) -> int | Setting:
    setting = _setting(value)
    if setting is not None:
        return setting
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_LIMIT:
        raise ValueError(
            f"concurrency must be a whole number from 1 to {MAX_LIMIT}, 'none' (no limit) or 'default' "
            f"(what the code declares), not {str(value)[:40]!r}"
        )
    return value


def _parse_rate(value: Any) -> Rate | Setting:
    setting = _setting(value)
    if setting is not None:
        return setting
    try:
        rate = Rate.parse(value)
    except ValueError:
        raise ValueError(
            f"rate limit must look like '10/s', '100/m' or '1000/h', or be 'none' (no limit) or 'default' "
            f"(what the code declares), not {str(value)[:40]!r}"
        ) from None
    if rate.count > MAX_LIMIT:
        raise ValueError(f"rate limit allows at most {MAX_LIMIT} claims per window, not {rate.count}")
    return rate


def parse_priority(value: Any) -> int:
    """A submit's priority: a whole number from 0 (the default) to MAX_PRIORITY."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_PRIORITY:
        raise InvalidPayload(f"priority must be a whole number from 0 to {MAX_PRIORITY}, not {str(value)[:40]!r}")
    return value
