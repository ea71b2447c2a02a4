"""Whether an error is the database refusing one of a statement's values (not being
away, not a bug in the statement): the caller reports the value, never the driver's
text, which quotes the whole statement."""

from __future__ import annotations

from sqlalchemy import exc as sa_exc

from celery_lease.errors import LeaseError


def refused_value(exc: BaseException) -> bool:
    """The database (or its driver) refused one of the values: SQLSTATE class 22, or
    a value the driver cannot even send (NUL in text, a lone surrogate)."""
    if isinstance(exc, LeaseError):
        return False
    orig = exc.orig if isinstance(exc, sa_exc.StatementError) else exc
    if isinstance(orig, (ValueError, UnicodeError, OverflowError)):
        return True
    return str(getattr(orig, "pgcode", "") or "").startswith("22")
