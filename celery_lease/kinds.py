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
    #: @leases.job(queue=...): the Celery task's own queue, which routing honours before
    #: task_routes (celery_lease.routing); None: task_routes or the default queue decide.
    queue: str | None
    #: Flow control (concurrency, concurrency_key, rate_limit); None: unlimited.
    limits: Limits | None = None
    #: Seconds an attempt may run before it is stopped and retried (None: no limit).
    timeout: float | None = None
    #: Up to this many due jobs of the kind claimed, run one after another and completed
    #: by one wakeup in one worker process (worker/batch.py); None: one job per wakeup.
    batch: int | None = None


#: The largest batch= a kind may declare: one claim's rows and one completion's bound
#: parameters (4 per job) stay far below PostgreSQL's 65,535.
MAX_BATCH = 1000


def check_batch(batch: Any, limits: Limits | None) -> int | None:
    """``batch=`` as declared, checked: an int from 1 to MAX_BATCH, and not combined with
    flow control's limits, which are counted per claim and per running job under a lock
    a batch claim does not take (a pause does apply to a batched kind)."""
    if batch is None:
        return None
    if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= MAX_BATCH:
        raise ValueError(f"batch must be an int from 1 to {MAX_BATCH}, not {batch!r}")
    if limits is not None:
        raise ValueError(
            "batch= cannot be combined with concurrency= or rate_limit=: a batch claims up to batch jobs at once, "
            "which no concurrency or rate limit would bound; declare a kind without batch= for limited work"
        )
    return batch


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
