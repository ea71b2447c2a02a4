"""celery-lease: durable, lease-based jobs for Celery.

The job row in SQL is the truth (status, attempts, lease, fencing generation, result,
error, checkpoint, progress); the broker only carries wakeups.
"""

from celery_lease.errors import (
    CheckpointTooLarge,
    ConfigurationError,
    DatabaseUnavailable,
    Failure,
    InvalidPayload,
    JobCancelled,
    JobSnoozed,
    JobSuspended,
    LeaseError,
    LeaseLost,
    UnknownKind,
)
from celery_lease.extension import CeleryLease
from celery_lease.job import Job
from celery_lease.shared import shared_job
from celery_lease.status import Status
from celery_lease.worker.context import JobContext

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
    "JobSnoozed",
    "JobSuspended",
    "LeaseError",
    "LeaseLost",
    "Status",
    "UnknownKind",
    "shared_job",
]
__version__ = "0.1.0"
