"""Exceptions raised by celery-lease.

* Control flow inside a handler, not errors: :class:`Failure` (give up: failed, no retry),
  :class:`JobCancelled` from ``ctx.raise_if_cancelled()`` (stop now, write nothing) and its
  :class:`JobSuspended` (warm shutdown: the job goes to another worker), :class:`JobSnoozed`
  from ``ctx.snooze(s)`` (pending again, due in s seconds, no attempt spent).
* Raised to Celery after the outcome is stored, so Flower shows the job's state:
  :class:`JobFailed` (carries only the stored error), its :class:`JobRefused` (the handler's
  own Failure: logged at INFO, no traceback), and ``celery.exceptions.Retry``.
* Errors of celery-lease, all under :class:`LeaseError`, whose docstring is each one's
  default message: ConfigurationError (names the setting), DatabaseUnavailable,
  InvalidPayload, UnknownKind, CheckpointTooLarge, LeaseLost (another attempt owns the job).
"""

from __future__ import annotations


class Failure(Exception):
    """The handler failed permanently; the job is marked failed without retry.

    The message is stored verbatim (capped at 512 bytes on a UTF-8 boundary), so it
    must be written for the user: never put a dependency's exception text in it.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = str(message)


class JobCancelled(Exception):
    """The job was cancelled or its lease was lost; the handler must stop."""


class JobSuspended(JobCancelled):
    """The worker is shutting down; the job goes back to pending for another worker."""


class JobSnoozed(Exception):
    """The handler snoozed its job: it is pending again, due later, attempt not spent."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"snoozed for {seconds:g}s")
        self.seconds = seconds


class JobFailed(Exception):
    """The job was recorded as failed (the stored error is the message)."""


class JobRefused(JobFailed):
    """The handler failed the job on purpose (``Failure``): one of a leased task's
    ``throws``, which Celery logs as an expected outcome (INFO, no traceback) rather than
    an error for the error tracker."""


class LeaseError(Exception):
    """celery-lease error."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class ConfigurationError(LeaseError):
    """celery-lease is not configured correctly."""


class DatabaseUnavailable(LeaseError):
    """The job database cannot be reached."""


class InvalidPayload(LeaseError, ValueError):
    """The payload was refused; nothing was stored."""


class UnknownKind(LeaseError, KeyError):
    """No job handler is registered for this kind."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class CheckpointTooLarge(LeaseError, ValueError):
    """The checkpoint exceeds its size cap."""


class LeaseLost(LeaseError):
    """The lease of this attempt was lost; its writes are discarded."""
