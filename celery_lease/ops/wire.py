"""The HTTP API's wire shapes: the pydantic models that make its OpenAPI schema
(:mod:`celery_lease.ops.api` serves them)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel


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


class JobSummaryOut(JobFields):
    """A job in a list: result or progress over 1 KiB is null (*_omitted); see one job's route."""

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


class LimitOut(BaseModel):
    kind: str
    #: The concurrency key (None: the kind as a whole).
    key: str | None = None
    concurrency: int | None = None
    rate_limit: str | None = None
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
