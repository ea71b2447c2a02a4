"""Job kinds: what ``@leases.job`` declares about a handler, and the registry of them.

A :class:`JobKind` is plain data (no Celery, no database), so the producer, the worker
and beat can all take it without depending on each other or on the facade.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

from celery_lease.errors import UnknownKind
from celery_lease.flow.limits import Limits
from celery_lease.payload import Codec


@dataclasses.dataclass(frozen=True)
class JobKind:
    kind: str
    #: The Celery task name its wakeups carry.
    task: str
    fn: Callable[..., Any]
    codec: Codec
    max_attempts: int
    lease_seconds: int
    retry_backoff: float
    retry_backoff_max: float
    #: The queue its wakeups go to (None: Celery's routing decides).
    queue: str | None
    #: Flow control (concurrency, concurrency_key, rate_limit); None: unlimited.
    limits: Limits | None = None
    #: Seconds an attempt may run before it is stopped and retried (None: no limit).
    timeout: float | None = None


class Registry:
    """The job kinds of one CeleryLease, by name. Anything with a ``spec`` attribute
    (a LeaseTask) resolves to its kind too."""

    def __init__(self) -> None:
        self._kinds: dict[str, JobKind] = {}

    def add(self, spec: JobKind) -> None:
        if spec.kind in self._kinds:
            raise ValueError(f"job kind {spec.kind!r} is already registered")
        self._kinds[spec.kind] = spec

    def resolve(self, kind: Any) -> JobKind:
        if isinstance(kind, JobKind):
            return kind
        spec = getattr(kind, "spec", None)
        if isinstance(spec, JobKind):
            return spec
        try:
            return self._kinds[kind]
        except (KeyError, TypeError):
            known = ", ".join(sorted(self._kinds)) or "none"
            raise UnknownKind(f"no job handler for kind {kind!r} (registered: {known})") from None

    def get(self, kind: str) -> JobKind | None:
        """The kind named ``kind``, or None when this process does not declare it."""
        return self._kinds.get(kind)

    def __iter__(self) -> Iterator[JobKind]:
        return iter(self._kinds.values())

    def names(self) -> list[str]:
        return sorted(self._kinds)
