"""The Job value: an immutable snapshot of one row of the jobs table."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from celery_lease.status import Status


def _utc(value: datetime | None) -> datetime | None:
    # SQLite hands back naive datetimes; every stored time is UTC.
    if value is not None and value.tzinfo is None:
        return value.replace(tzinfo=timezone.utc)
    return value


@dataclasses.dataclass(frozen=True)
class Job:
    id: str
    kind: str
    status: Status
    attempt: int
    max_attempts: int
    payload: Any
    result: Any
    progress: Any
    error: str | None
    lease_owner: str | None
    lease_expires_at: datetime | None
    lease_generation: int
    lease_losses: int
    run_after: datetime | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    run_id: str | None
    parent_id: str | None
    idempotency_key: str | None
    tenant: str | None
    task: str
    queue: str | None
    priority: int = 0

    @classmethod
    def from_row(cls, row: Mapping[Any, Any]) -> Job:
        return cls(
            id=str(row["id"]),
            kind=row["kind"],
            status=Status(row["status"]),
            attempt=row["attempt"],
            max_attempts=row["max_attempts"],
            payload=row["payload"],
            result=row["result"],
            progress=row["progress"],
            error=row["error"],
            lease_owner=row["lease_owner"],
            lease_expires_at=_utc(row["lease_expires_at"]),
            lease_generation=row["lease_generation"],
            lease_losses=row["lease_losses"],
            run_after=_utc(row["run_after"]),
            created_at=_utc(row["created_at"]) or row["created_at"],
            started_at=_utc(row["started_at"]),
            finished_at=_utc(row["finished_at"]),
            run_id=None if row["run_id"] is None else str(row["run_id"]),
            parent_id=None if row["parent_id"] is None else str(row["parent_id"]),
            idempotency_key=row["idempotency_key"],
            tenant=row["tenant"],
            task=row["task"],
            queue=row["queue"],
            priority=row.get("priority", 0),
        )

    @property
    def terminal(self) -> bool:
        return self.status.terminal

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready view used by the CLI and the HTTP API."""
        out = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, datetime):
                value = value.isoformat()
            elif isinstance(value, Status):
                value = value.value
            out[field.name] = value
        return out


def parse_job_id(value: Any) -> str:
    """Validate a job (or run) id at the boundary; raises ValueError."""
    try:
        return str(uuid.UUID(str(value)))
    except ValueError:
        raise ValueError(f"not a job id (expected a UUID): {str(value)[:64]!r}") from None
