"""Job statuses, why flow control holds a pending job, and the events of a run's log."""

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


class Held(str, enum.Enum):
    """Why flow control holds a pending job (``jobs.held``; NULL: nothing holds it).

    A held job's wakeup is spent and nothing polls it: it is woken (held cleared) when
    its cause ends, or by the sweeper's recovery (celery_lease.flow)."""

    #: Its kind is paused. Cleared by: resume.
    PAUSE = "pause"
    #: Its kind's rate window is spent. Cleared by: the next window's wakeup, the first
    #: claim of a window (which wakes as many as the window still takes).
    RATE = "rate"
    #: ``concurrency`` jobs of its kind and key run. Cleared by: a release of a slot.
    LIMIT = "limit"

    def __str__(self) -> str:
        return self.value


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


class AttemptOutcome(str, enum.Enum):
    """How an attempt ended, in the job's attempt log (db/statements/attempt_log.py)."""

    RUNNING = "running"  # not ended yet
    SUCCEEDED = "succeeded"
    FAILED = "failed"  # a Failure, an unstorable value, or an error on the last attempt
    RETRIED = "retried"  # an error with attempts left
    TIMED_OUT = "timed out"  # past the kind's timeout (retried, or failed on the last attempt)
    SNOOZED = "snoozed"
    HANDED_OFF = "handed off"  # warm shutdown, or a claim that came too late in its lease
    LEASE_EXPIRED = "lease expired"  # reaped: the worker stopped renewing (killed, lost, stalled)
    INTERRUPTED = "interrupted"  # its worker node restarted (restart recovery)
    CANCELLED = "cancelled"

    def __str__(self) -> str:
        return self.value
