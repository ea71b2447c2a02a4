"""Exceptions raised by celery-lease.

Control flow inside a handler (not errors of celery-lease itself)::

    Failure                 the handler gives up: job -> failed, message stored, no retry
    JobCancelled            raised by ctx.raise_if_cancelled(): stop now, write nothing
     └── JobSuspended       warm shutdown: stop now, the job is handed to another worker
    JobSnoozed              raised by ctx.snooze(s): back to pending, due in s seconds,
                            no attempt spent

Raised to Celery after the outcome is stored, so Flower shows the job's state::

    JobFailed               the job is failed; carries only the stored error
     └── JobRefused         ... by the handler's own Failure (or a refused value): an
                            expected outcome, so Celery logs it at INFO, no traceback
    celery.exceptions.Retry the job will run again after its backoff

Errors of celery-lease, all under one base::

    LeaseError
     ├── ConfigurationError     a setting is missing or wrong (names the setting)
     ├── DatabaseUnavailable    the job database cannot be reached
     ├── InvalidPayload         submit refused the payload; nothing was stored
     ├── UnknownKind            submit named a kind no @leases.job registered
     ├── CheckpointTooLarge     a checkpoint exceeds its cap (on save or on load)
     └── LeaseLost              a fenced write matched no row: another attempt, the
                                reaper or a cancel owns the job now

Every class's docstring is its default message.
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
