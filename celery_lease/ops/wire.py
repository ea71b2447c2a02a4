"""The HTTP API's wire shapes: the pydantic models that make its OpenAPI schema
(:mod:`celery_lease.ops.api` serves them)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from celery_lease.flow.limits import MAX_LIMIT


class ErrorOut(BaseModel):
    error: str
    detail: str | None = None


class JobFields(BaseModel):
    id: str
    kind: str
    #: The queue Celery routes the job's task to, where its wakeups go (null: routed by exchange, or
    #: a job stored before routing was recorded).
    queue: str | None = None
    status: str
    result: Any = None
    error: str | None = None
    progress: Any = None
    attempt: int
    max_attempts: int
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    run_id: str | None = None
    parent_id: str | None = None


class AttemptOut(BaseModel):
    attempt: int
    #: The Celery node name (name@host) that ran it; null for a tenant's token.
    worker: str | None = None
    started_at: datetime
    #: Null while it runs.
    ended_at: datetime | None = None
    #: running, succeeded, failed, retried, timed out, snoozed, handed off, lease expired,
    #: interrupted (its worker restarted) or cancelled.
    outcome: str


class JobOut(JobFields):
    #: Every attempt in order (at most the last 50).
    attempts: list[AttemptOut] = []
    #: True when the stored value nests lists and objects deeper than 100 levels (stored
    #: before that was refused): shown as null.
    result_omitted: bool = False
    progress_omitted: bool = False


class JobSummaryOut(JobFields):
    """A job in a list: result or progress over 1 KiB (see one job's route), or nested
    deeper than 100 levels, is null (*_omitted)."""

    result_bytes: int | None = None
    result_omitted: bool = False
    progress_bytes: int | None = None
    progress_omitted: bool = False


class JobPageOut(BaseModel):
    jobs: list[JobSummaryOut]
    next_cursor: str | None = None


class CancelOut(BaseModel):
    id: str
    #: True when this request moved the job to cancelled; False when it was terminal.
    cancelled: bool
    status: str


class RetryOut(BaseModel):
    #: The new job: same kind, payload, queue, priority, run and tenant as the retried one.
    job_id: str


class EventOut(BaseModel):
    #: The event's id; for a tenant token, its number among the tenant's events of the run.
    id: int
    run_id: str
    job_id: str
    event: str
    attempt: int
    detail: str | None = None
    created_at: datetime


class EventPageOut(BaseModel):
    run_id: str
    events: list[EventOut]
    #: Pass as ``after`` for the next page; None when this page is the last.
    next_after: int | None = None


#: A rate as the API takes it: what flow.limits.Rate.parse takes (count 1 to MAX_LIMIT),
#: without spaces, so that the schema and the server refuse exactly the same strings.
RATE_PATTERN = r"^0*([1-9][0-9]{0,5}|1000000)/[smh]$"
assert MAX_LIMIT == 1_000_000, "RATE_PATTERN spells MAX_LIMIT out"


def _number(value: Any) -> Any:
    # A JSON number only (437 or 437.0, as JSON Schema's integer): not "437", not true.
    if isinstance(value, (str, bool)):
        raise ValueError("must be a JSON number")
    return value


class LimitsIn(BaseModel):
    """PUT /api/v1/kinds/{kind}/limits. A field left out is unchanged; null is no limit
    (whatever the code declares); "default" is what the code declares."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"minProperties": 1})

    concurrency: Annotated[int, Field(ge=1, le=MAX_LIMIT), BeforeValidator(_number)] | Literal["none", "default"] | None = None
    rate_limit: Annotated[str, Field(pattern=RATE_PATTERN)] | Literal["none", "default"] | None = None


class KindLimitsOut(BaseModel):
    """A kind's limits in force (None: no limit), where each comes from ("code": what
    ``@leases.job`` declares; "override": an operator's), and what the code declares."""

    kind: str
    concurrency: int | None = None
    rate_limit: str | None = None
    concurrency_source: str
    rate_limit_source: str
    declared_concurrency: int | None = None
    declared_rate_limit: str | None = None


class LimitOut(KindLimitsOut):
    #: The concurrency key (None: the kind as a whole); for a token that may not read
    #: payloads, a label standing for it ("key-" and 12 hex digits: keys are payload text).
    key: str | None = None
    paused: bool
    running: int
    #: Pending jobs held back by the kind's concurrency limit, its rate, or its pause.
    waiting_limit: int
    waiting_rate: int
    waiting_pause: int
    #: Other pending jobs (queued for a worker, or due later).
    pending: int


class LimitsOut(BaseModel):
    kinds: list[LimitOut]


class HealthOut(BaseModel):
    status: str
