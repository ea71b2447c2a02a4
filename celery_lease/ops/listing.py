"""Pages of jobs, shared by the CLI and the HTTP API.

Filters are validated here, at the boundary, so both interfaces refuse the same bad
input with the same message (a ValueError) before anything reaches the database.

Pages are keyset pages on (created_at, id), newest first. The cursor is an opaque,
URL-safe token naming the last row of the previous page; rows inserted while a client
pages sort before that row, so they never shift, duplicate or skip the rows of later
pages. A cursor carries no tenant: the tenant filter is applied on every page from the
caller's credentials, so a cursor cannot widen what a caller sees.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import uuid
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from celery_lease.job import Job, attempt_history
from celery_lease.payload import too_deep
from celery_lease.status import Status

if TYPE_CHECKING:
    from celery_lease.extension import CeleryLease

DEFAULT_LIMIT = 50
MAX_LIMIT = 500
#: Longer than any cursor this module makes; a longer token is refused unread.
MAX_CURSOR_CHARS = 200
#: The width of the ``kind`` column: no longer kind can exist.
MAX_KIND_CHARS = 200
#: The width of the ``queue`` column.
MAX_QUEUE_CHARS = 200

#: A list row carries a job's result or progress only up to this size (its JSON text).
SUMMARY_VALUE_BYTES = 1024
#: A list page stops before the row that would take its rows past this many bytes (of
#: JSON); its cursor continues from there. At least one row is always returned.
MAX_PAGE_BYTES = 1024 * 1024

#: What the HTTP API shows of a job (the payload and lease internals stay private).
API_FIELDS = (
    "id",
    "kind",
    "queue",
    "status",
    "result",
    "error",
    "progress",
    "attempt",
    "max_attempts",
    "created_at",
    "started_at",
    "finished_at",
    "run_id",
    "parent_id",
)


def parse_status(value: str | None) -> str | None:
    if value is None:
        return None
    try:
        return Status(value).value
    except ValueError:
        known = ", ".join(s.value for s in Status)
        raise ValueError(f"unknown status {value[:40]!r} (one of: {known})") from None


def _column_text(value: str | None, width: int, what: str) -> str | None:
    if value is None:
        return None
    # PostgreSQL text cannot hold NUL; refusing it here keeps it a 400, not a 500.
    if len(value) > width or "\x00" in value:
        raise ValueError(f"not {what}: at most {width} characters, no NUL")
    return value


def parse_kind(value: str | None) -> str | None:
    return _column_text(value, MAX_KIND_CHARS, "a job kind")


def parse_queue(value: str | None) -> str | None:
    return _column_text(value, MAX_QUEUE_CHARS, "a queue name")


def parse_limit(value: Any) -> int:
    try:
        limit = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"limit must be an integer from 1 to {MAX_LIMIT}, not {str(value)[:40]!r}") from None
    if not 1 <= limit <= MAX_LIMIT:
        raise ValueError(f"limit must be an integer from 1 to {MAX_LIMIT}, not {limit}")
    return limit


def encode_cursor(job: Job | Mapping[str, Any]) -> str:
    """The cursor after ``job`` (a Job or an API view row)."""
    created_at, job_id = (job["created_at"], job["id"]) if isinstance(job, Mapping) else (job.created_at, job.id)
    raw = json.dumps([created_at.astimezone(timezone.utc).isoformat(), str(job_id)], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(token: str | None) -> tuple[datetime, str] | None:
    if token is None:
        return None
    bad = ValueError("malformed cursor (pass back the next_cursor of a previous page)")
    if len(token) > MAX_CURSOR_CHARS:
        raise bad
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        created, job_id = json.loads(raw)
        created_at = datetime.fromisoformat(created)
        job_id = str(uuid.UUID(job_id))
    except (binascii.Error, UnicodeDecodeError, TypeError, ValueError, AttributeError):
        raise bad from None
    if created_at.tzinfo is None:
        raise bad
    try:
        # In UTC: PostgreSQL refuses offsets beyond +-15:59 that Python accepts, and
        # SQLite compares times as text, which only works in one zone.
        created_at = created_at.astimezone(timezone.utc)
    except (OverflowError, ValueError):  # e.g. year 1 with a positive offset
        raise bad from None
    return created_at, job_id


@dataclasses.dataclass(frozen=True)
class Query:
    """A validated request for one page."""

    status: str | None = None
    kind: str | None = None
    limit: int = DEFAULT_LIMIT
    after: tuple[datetime, str] | None = None
    #: The job's routed queue (celery_lease.broker.routing).
    queue: str | None = None

    @classmethod
    def parse(
        cls,
        *,
        status: str | None = None,
        kind: str | None = None,
        limit: Any = DEFAULT_LIMIT,
        cursor: str | None = None,
        queue: str | None = None,
    ) -> Query:
        """Raises ValueError, naming what is wrong, before anything is read."""
        return cls(parse_status(status), parse_kind(kind), parse_limit(limit), decode_cursor(cursor), parse_queue(queue))


@dataclasses.dataclass(frozen=True)
class Page:
    jobs: list[Job]
    #: Pass back to get the next page; None on the last page.
    next_cursor: str | None


def list_page(leases: CeleryLease, query: Query, *, tenant: str | None = None) -> Page:
    """One page of jobs, newest first. ``tenant`` None means every tenant."""
    # One row more than asked tells whether another page exists.
    jobs = leases.store.list_jobs(
        status=query.status, kind=query.kind, queue=query.queue, tenant=tenant, after=query.after, limit=query.limit + 1
    )
    more = len(jobs) > query.limit
    jobs = jobs[: query.limit]
    return Page(jobs, encode_cursor(jobs[-1]) if more else None)


@dataclasses.dataclass(frozen=True)
class ViewPage:
    #: API view rows (API_FIELDS), newest first.
    rows: list[dict[str, Any]]
    next_cursor: str | None


def list_view_page(leases: CeleryLease, query: Query, *, tenant: str | None = None) -> ViewPage:
    """list_page as summaries (:func:`summary_view`): only the columns the API shows (no
    payloads, checkpoints), a result or progress only up to SUMMARY_VALUE_BYTES, and
    the page cut short (with a cursor) where it would pass MAX_PAGE_BYTES."""
    rows = leases.store.list_summaries(
        max_value_bytes=SUMMARY_VALUE_BYTES,
        status=query.status,
        kind=query.kind,
        queue=query.queue,
        tenant=tenant,
        after=query.after,
        limit=query.limit + 1,
    )
    more = len(rows) > query.limit
    rows = [summary_view(r) for r in rows[: query.limit]]
    size = 0
    for count, row in enumerate(rows):
        size += len(json.dumps(row, default=str, ensure_ascii=False).encode())
        if size > MAX_PAGE_BYTES and count > 0:
            rows, more = rows[:count], True
            break
    return ViewPage(rows, encode_cursor(rows[-1]) if more else None)


def summary_view(row: Mapping[str, Any]) -> dict[str, Any]:
    """A list row: API_FIELDS, with ``result``/``progress`` None and ``*_omitted`` true
    when the value is over SUMMARY_VALUE_BYTES (``*_bytes``: the stored JSON's size;
    the job's own route returns it whole) or nested too deep (:func:`shown_values`)."""
    out = shown_values(row)
    for name in ("result", "progress"):
        size = row[f"{name}_bytes"]
        out[f"{name}_bytes"] = size
        out[f"{name}_omitted"] = out[f"{name}_omitted"] or (size is not None and size > SUMMARY_VALUE_BYTES)
    return out


def shown_values(job: Mapping[str, Any]) -> dict[str, Any]:
    """API_FIELDS of a job, with ``result``/``progress`` None and ``*_omitted`` true when
    the stored value nests deeper than payload.MAX_JSON_DEPTH: stored before that was
    refused, it would fail every JSON serializer of the response, for good."""
    out = {name: job[name] for name in API_FIELDS}
    for name in ("result", "progress"):
        hidden = out[name] is not None and too_deep(out[name])
        out[f"{name}_omitted"] = hidden
        if hidden:
            out[name] = None
    return out


def attempts_view(log: Any, *, show_worker: bool) -> list[dict[str, Any]]:
    """A job's attempts (job.attempt_history); a tenant's token sees no worker host."""
    return [entry if show_worker else {**entry, "worker": None} for entry in attempt_history(log)]


def api_view(job: Job | Mapping[str, Any]) -> dict[str, Any]:
    """One job as the API shows it (:func:`shown_values`)."""
    return shown_values(job if isinstance(job, Mapping) else job.to_dict())
