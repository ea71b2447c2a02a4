"""The Job value: an immutable snapshot of one row of the jobs table."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from celery_lease.errors import JobFailed, LeaseError
from celery_lease.status import Status


def _utc(value: datetime | None) -> datetime | None:
    # SQLite hands back naive datetimes; every stored time is UTC.
    if value is not None and value.tzinfo is None:
        return value.replace(tzinfo=timezone.utc)
    return value


def _stamp(value: str | None) -> datetime | None:
    # The attempt log's times are the database's text: ISO 8601 with an offset
    # (PostgreSQL), or UTC without one (SQLite).
    return None if value is None else _utc(datetime.fromisoformat(value))


def attempt_history(log: Any) -> tuple[dict[str, Any], ...]:
    """The attempt log (column ``attempts``, db/statements/attempt_log.py) as shown:
    one entry per attempt in order, ``{"attempt", "worker", "started_at", "ended_at",
    "outcome"}``, where ``worker`` is the Celery node name (``name@host``) of the lease
    owner (``node/pid/boot``) and ``ended_at`` is None while it runs."""
    return tuple(
        {
            "attempt": entry["attempt"],
            "worker": entry["owner"].rsplit("/", 2)[0],
            "started_at": _stamp(entry["started_at"]),
            "ended_at": _stamp(entry["ended_at"]),
            "outcome": entry["outcome"],
        }
        for entry in log or ()
    )


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
    #: attempt_history: every attempt (at most the last 50), in order.
    attempts: tuple[dict[str, Any], ...] = ()

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
            attempts=attempt_history(row.get("attempts")),
        )

    @classmethod
    def of_fields(cls, fields: dict[str, Any]) -> Job:
        """A Job from every one of its fields, already of the right types: a submit
        builds thousands from what it sent, where the checking constructor (one
        ``object.__setattr__`` per field of a frozen dataclass) costs more than the rest."""
        job = object.__new__(cls)
        job.__dict__.update(fields)
        return job

    @staticmethod
    def pending_fields(shared: Mapping[str, Any]) -> dict[str, Any]:
        """The fields every new job of one submit shares, from the columns it binds once
        (id, payload, idempotency key, created_at and run_after are each job's own)."""
        return {
            "kind": shared["kind"],
            "status": Status(shared["status"]),
            "attempt": shared["attempt"],
            "max_attempts": shared["max_attempts"],
            "result": None,
            "progress": None,
            "error": None,
            "lease_owner": None,
            "lease_expires_at": None,
            "lease_generation": shared["lease_generation"],
            "lease_losses": shared["lease_losses"],
            "started_at": None,
            "finished_at": None,
            "run_id": shared["run_id"],
            "parent_id": shared["parent_id"],
            "tenant": shared["tenant"],
            "task": shared["task"],
            "queue": shared["queue"],
            "priority": shared["priority"],
        }

    @property
    def terminal(self) -> bool:
        return self.status.terminal

    def exception(self) -> Exception | None:
        """What ``get()`` raises for this job: JobFailed with the stored error for a failed
        or expired job, Celery's TaskRevokedError for a cancelled one, else None."""
        if self.status in (Status.FAILED, Status.EXPIRED):
            return JobFailed(self.error or self.status.value)
        if self.status is Status.CANCELLED:
            from celery.exceptions import TaskRevokedError

            return TaskRevokedError(f"job {self.id} was cancelled")
        return None

    def bind(self, owner: Any) -> Job:
        """Attach the CeleryLease that can read this job again (for ``get``)."""
        object.__setattr__(self, "_owner", owner)
        return self

    def __getstate__(self) -> dict[str, Any]:
        # A pickled or copied Job is a plain value: the owner (engines, an app) stays here.
        return {k: v for k, v in self.__dict__.items() if k != "_owner"}

    def get(self, timeout: float | None = None, propagate: bool = True, interval: float = 0.1) -> Any:
        """Wait until the job is terminal and return its result, as Celery's
        ``AsyncResult.get`` does: with ``propagate`` a failed or expired job raises
        JobFailed and a cancelled one TaskRevokedError; past ``timeout`` seconds it raises
        celery.exceptions.TimeoutError."""
        owner = self.__dict__.get("_owner")
        if owner is None:
            raise LeaseError("this Job was not returned by a CeleryLease; use leases.wait(job.id)")
        from celery.exceptions import TimeoutError as CeleryTimeout

        try:
            done = owner.wait(self.id, timeout=float("inf") if timeout is None else timeout, poll=interval)
        except TimeoutError:
            raise CeleryTimeout(f"job {self.id} did not finish within {timeout}s") from None
        error = done.exception()
        if error is not None:
            if propagate:
                raise error
            return error
        return done.result

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready view used by the CLI and the HTTP API."""
        out = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, datetime):
                value = value.isoformat()
            elif isinstance(value, Status):
                value = value.value
            elif field.name == "attempts":
                value = [{k: v.isoformat() if isinstance(v, datetime) else v for k, v in a.items()} for a in value]
            out[field.name] = value
        return out


def parse_job_id(value: Any) -> str:
    """Validate a job (or run) id at the boundary; raises ValueError."""
    try:
        return str(uuid.UUID(str(value)))
    except ValueError:
        raise ValueError(f"not a job id (expected a UUID): {str(value)[:64]!r}") from None
