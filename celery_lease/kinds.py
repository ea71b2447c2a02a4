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
    #: task_routes (celery_lease.broker.routing); None: task_routes or the default queue decide.
    queue: str | None
    #: Flow control (concurrency, concurrency_key, rate_limit); None: unlimited.
    limits: Limits | None = None
    #: Seconds an attempt may run before it is stopped and retried (None: no limit).
    timeout: float | None = None
    #: Up to this many due jobs of the kind claimed, run one after another and completed
    #: by one wakeup in one worker process (worker/many_claim.py); None: one job per wakeup.
    batch: int | None = None
    #: Claims share the fleet among the kind's tenants by weight (statements/fair.py).
    fair: bool = False


#: The largest batch= a kind may declare: one claim's rows and one completion's bound
#: parameters (4 per job) stay far below PostgreSQL's 65,535.
MAX_BATCH = 1000


def check_batch(batch: Any, limits: Limits | None) -> int | None:
    """``batch=`` as declared, checked: an int from 1 to MAX_BATCH. It combines with
    flow control's limits (``limits``): a limited kind's many-job claim takes the kind's
    limits row lock and claims, in the same statement, no more than its free slots (per
    concurrency key) and what its rate window still takes (db/statements/many_claim.py:
    claim_many_limited); a pause applies too. (On SQLite a ``batch=`` kind claims one job
    per wakeup, through the single claim, limited or not.)"""
    if batch is None:
        return None
    if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= MAX_BATCH:
        raise ValueError(f"batch must be an int from 1 to {MAX_BATCH}, not {batch!r}")
    return batch


#: Celery task options that ``@leases.job`` does not take, with what a leased job does
#: instead: refused at declaration, never silently ignored.
CELERY_TASK_OPTIONS = {
    "bind": "the handler always receives its JobContext first (ctx.job_id, ctx.attempt, ctx.fencing_token): drop bind=True",
    "max_retries": "use max_attempts=, which counts the first run too (max_retries=N is max_attempts=N + 1)",
    "autoretry_for": "every exception is retried, with exponential backoff, while attempts remain: drop it, and "
    "raise celery_lease.Failure for an error that must not be retried",
    "retry_kwargs": "use max_attempts=, retry_backoff= and retry_backoff_max=",
    "default_retry_delay": "retries back off exponentially from retry_backoff= seconds, up to retry_backoff_max=",
    "retry_jitter": "retry delays are always jittered (0.5x to 1.5x)",
    "acks_late": "the lease replaces it: a killed worker's job is run again when its lease elapses",
    "time_limit": "use timeout= (seconds an attempt may run)",
    "soft_time_limit": "use timeout= and ctx.raise_if_cancelled()",
}


def refuse_celery_options(options: dict[str, Any]) -> None:
    """Raise TypeError naming what to use instead of a Celery task option given to ``@leases.job``."""
    for key in options:
        hint = CELERY_TASK_OPTIONS.get(key)
        if hint is None:
            raise TypeError(f"@leases.job() got an unexpected keyword argument {key!r}")
        raise TypeError(f"@leases.job({key}=...) is a Celery task option a leased job does not take: {hint}")


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

    def claims_many(self, task: str) -> bool:
        """Whether a delivery of ``task`` claims what is due of its kind, many jobs at a
        time (worker/many_claim.py): a kind with ``batch=``, or with no limit in its code (a
        kind with a declared limit claims one job per delivery, under its limits row).
        A task of no kind here: False."""
        for spec in self._kinds.values():
            if spec.task == task:
                return spec.batch is not None or spec.limits is None
        return False

    def __iter__(self) -> Iterator[JobKind]:
        return iter(self._kinds.values())

    def names(self) -> list[str]:
        return sorted(self._kinds)
