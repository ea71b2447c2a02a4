"""How an attempt's body ended, and what follows from it: the outcome, the error
stored for a timeout, and the backoff before a retry."""

from __future__ import annotations

import enum
import random

#: The stored error of a job whose last attempt ran past its kind's timeout.
TIMED_OUT = "timed out"


def backoff(attempt: int, base: float, cap: float) -> float:
    """Exponential backoff with jitter: base * 2^(attempt-1), capped, times 0.5..1.5."""
    return min(cap, base * 2 ** max(0, attempt - 1)) * random.uniform(0.5, 1.5)


class Outcome(enum.Enum):
    """How a handler's body ended, before it is recorded."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"  # Failure(msg): no retry
    SUSPENDED = "suspended"  # warm shutdown: hand the job off
    SNOOZED = "snoozed"  # ctx.snooze(): back to pending, due later, attempt not spent
    CANCELLED = "cancelled"  # lease lost or job cancelled: write nothing
    ERROR = "error"  # any other exception: retry while attempts remain
