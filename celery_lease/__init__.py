"""celery-lease: durable, lease-based jobs for Celery.

The job row in SQL is the truth (status, attempts, lease, fencing generation, result,
error, checkpoint, progress); the broker only carries wakeups.
"""

from .context import JobContext
from .errors import (
    CheckpointTooLarge,
    ConfigurationError,
    DatabaseUnavailable,
    Failure,
    InvalidPayload,
    JobCancelled,
    JobSuspended,
    LeaseError,
    LeaseLost,
    UnknownKind,
)
from .extension import CeleryLease
from .job import Job
from .status import Status

__all__ = [
    "CeleryLease",
    "CheckpointTooLarge",
    "ConfigurationError",
    "DatabaseUnavailable",
    "Failure",
    "InvalidPayload",
    "Job",
    "JobCancelled",
    "JobContext",
    "JobSuspended",
    "LeaseError",
    "LeaseLost",
    "Status",
    "UnknownKind",
]
__version__ = "0.1.0"
