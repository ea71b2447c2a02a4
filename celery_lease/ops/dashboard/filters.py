"""The job list's filters, read from a query string and validated at the boundary:
bad input is a message on the page (a ValueError here), never a database error.

Empty fields count as absent (an HTML form sends every field). Times are UTC, as
``2026-12-01T13:05`` (what a ``datetime-local`` input sends) or with seconds and an
offset. A tenant viewer's filter always carries its own tenant, whatever was asked;
a payload field is searched only for a viewer who may read payloads (finding jobs by a
payload's value would reveal it, one guess at a time).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any
from urllib.parse import urlencode

from celery_lease.db.statements.dashboard import Filter
from celery_lease.job import parse_job_id
from celery_lease.ops import listing

#: The query parameters the job list (and its bulk actions) take.
FILTER_FIELDS = ("status", "kind", "queue", "tenant", "run", "since", "until", "field", "value")
PARAMS = (*FILTER_FIELDS, "q", "cursor")
MAX_TEXT = 200
#: A payload field is one top-level key: letters, digits, ``_ - .``.
_FIELD = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


def _text(value: str | None, what: str) -> str | None:
    if value is None or value == "":
        return None
    if len(value) > MAX_TEXT or "\x00" in value:
        raise ValueError(f"{what}: at most {MAX_TEXT} characters, no NUL")
    return value


def _time(value: str | None, what: str) -> datetime | None:
    if not value:
        return None
    try:
        when = datetime.fromisoformat(value[:40])
    except ValueError:
        raise ValueError(f"{what}: not a time (expected e.g. 2026-12-01T13:05, UTC)") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    try:
        return when.astimezone(timezone.utc)
    except (OverflowError, ValueError):
        raise ValueError(f"{what}: out of range") from None


def parse(params: Mapping[str, str], *, tenant: str | None, payloads: bool) -> Filter:
    """A Filter from the query string (ValueError naming the bad field)."""
    unknown = sorted(set(params) - set(PARAMS))
    if unknown:
        raise ValueError(f"unknown filter {unknown[0][:40]!r}")
    run = _text(params.get("run"), "run")
    if run is not None:
        try:
            run = parse_job_id(run)
        except ValueError:
            raise ValueError("run: not a run id (a UUID)") from None
    field, value = _text(params.get("field"), "payload field"), _text(params.get("value"), "payload value")
    if field is not None and not _FIELD.match(field):
        raise ValueError("payload field: one top-level key (letters, digits, _ - .)")
    if (field is None) != (value is None):
        raise ValueError("payload search needs both a field and a value")
    if field is not None and not payloads:
        raise ValueError("payload search: this token may not read payloads")
    return Filter(
        status=listing.parse_status(_text(params.get("status"), "status")),
        kind=listing.parse_kind(_text(params.get("kind"), "kind")),
        queue=_text(params.get("queue"), "queue"),
        tenant=tenant if tenant is not None else _text(params.get("tenant"), "tenant"),
        run_id=run,
        since=_time(params.get("since"), "from"),
        until=_time(params.get("until"), "until"),
        field=field,
        value=value,
    )


def query_string(f: Filter, **extra: Any) -> str:
    """The query string that reproduces ``f`` (plus ``extra``), for links and forms."""
    values = {
        "status": f.status,
        "kind": f.kind,
        "queue": f.queue,
        "tenant": f.tenant,
        "run": f.run_id,
        "since": f.since.strftime("%Y-%m-%dT%H:%M:%S") if f.since else None,
        "until": f.until.strftime("%Y-%m-%dT%H:%M:%S") if f.until else None,
        "field": f.field,
        "value": f.value,
        **extra,
    }
    return urlencode({k: v for k, v in values.items() if v is not None})


def form_values(f: Filter) -> dict[str, str]:
    """The filter as the list's form shows it back."""
    return {
        "status": f.status or "",
        "kind": f.kind or "",
        "queue": f.queue or "",
        "tenant": f.tenant or "",
        "run": f.run_id or "",
        "since": f.since.strftime("%Y-%m-%dT%H:%M") if f.since else "",
        "until": f.until.strftime("%Y-%m-%dT%H:%M") if f.until else "",
        "field": f.field or "",
        "value": f.value or "",
    }
