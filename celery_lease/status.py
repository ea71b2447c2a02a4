"""Job statuses and the events of a run's log."""

from __future__ import annotations

import enum


class Status(str, enum.Enum):
    #: Waiting for a worker. Left by: claim (-> running), cancel (-> cancelled).
    PENDING = "pending"
    #: Leased by one attempt. Left by: that attempt's completion (-> succeeded / failed,
    #: or -> pending for a retry or a shutdown handoff), the reaper (-> pending /
    #: expired), restart recovery (-> pending / failed), cancel (-> cancelled).
    RUNNING = "running"
    #: Terminal: never left. Every statement that moves a job guards on a non-terminal
    #: status, so a finished or cancelled job is never resurrected.
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL

    def __str__(self) -> str:
        return self.value


TERMINAL = frozenset({Status.SUCCEEDED, Status.FAILED, Status.EXPIRED, Status.CANCELLED})
ACTIVE = frozenset({Status.PENDING, Status.RUNNING})


class Event(str, enum.Enum):
    """What a run's append-only event log records about its jobs."""

    DISPATCHED = "dispatched"
    CLAIMED = "claimed"
    RETRIED = "retried"
    REAPED = "reaped"  # lease expired: requeued or expired
    REQUEUED = "requeued"  # restart recovery or shutdown handoff
    FAILED = "failed"
    CANCELLED = "cancelled"
    SUCCEEDED = "succeeded"

    def __str__(self) -> str:
        return self.value
