"""What every ``celery lease`` command shares: the command group, the one-line error
exit, the app's CeleryLease, and how values are shown on a terminal."""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Callable
from datetime import datetime
from typing import Any

import click
from sqlalchemy import exc as sa_exc

from celery_lease.errors import LeaseError
from celery_lease.job import parse_job_id
from celery_lease.status import Status


class CliError(click.ClickException):
    """One line on stderr, no usage text, no traceback."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code  # type: ignore[misc]  # click declares it on the class

    def show(self, file=None) -> None:
        click.echo(f"celery-lease: {self.format_message()}", err=True)


#: Characters a terminal would act on rather than show: C0/C1 controls (escape
#: sequences, bell, carriage return), bidirectional overrides and lone surrogates.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def printable(text: str) -> str:
    """``text`` with every control character spelt as an escape (``\\x1b``): job data
    is whatever a handler or submitter wrote, and must not drive the terminal."""
    return _UNPRINTABLE.sub(lambda m: repr(m.group())[1:-1], text)


#: Celery's state names (what Flower and AsyncResult show) for the statuses they mean:
#: FAILURE is ``failed`` (``expired`` is asked for apart); RETRY jobs are ``pending``.
CELERY_STATES = {
    "PENDING": Status.PENDING,
    "RETRY": Status.PENDING,
    "STARTED": Status.RUNNING,
    "SUCCESS": Status.SUCCEEDED,
    "FAILURE": Status.FAILED,
    "REVOKED": Status.CANCELLED,
}


def _status(value: str | None) -> str | None:
    """``--status`` as a status in any case, or a Celery state name (SUCCESS, FAILURE...)."""
    if value is None:
        return None
    celery = CELERY_STATES.get(value.upper())
    return celery.value if celery is not None else value.lower()


def _short(text: str, width: int = 40) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _when(value: datetime | None) -> str:
    return "" if value is None else value.strftime("%Y-%m-%d %H:%M:%S")


def _table(headings: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headings)]
    lines = [headings, *rows]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)


def _emit(as_json: bool, data: Any, text: str) -> None:
    click.echo(json.dumps(data, indent=2, default=str) if as_json else text)


def _id(value: str, what: str = "job") -> str:
    try:
        return parse_job_id(value)
    except ValueError:
        raise CliError(f"malformed {what} id {value[:64]!r} (expected a UUID)", exit_code=2) from None


#: ``show`` takes an id's first hex digits, at least this many (the dashboard shows 8).
MIN_PREFIX = 8
#: The ids an ambiguous prefix lists.
PREFIX_CANDIDATES = 5
_PREFIX = re.compile(rf"[0-9a-f]{{{MIN_PREFIX},32}}")


def _id_or_prefix(leases, value: str) -> str:
    """A job id, or the one job whose id starts with ``value`` (hex digits, hyphens
    ignored): read as a range of the primary key, never a scan of the table."""
    try:
        return parse_job_id(value)
    except ValueError:
        pass
    digits = value.replace("-", "").lower()
    if not _PREFIX.fullmatch(digits):
        raise CliError(
            f"malformed job id {value[:64]!r} (expected a UUID, or at least {MIN_PREFIX} of its first hex digits)", exit_code=2
        )
    found = leases.store.ids_with_prefix(digits, PREFIX_CANDIDATES + 1)
    if not found:
        raise CliError(f"no job whose id starts with {value!r}")
    if len(found) > 1:
        more = ", ..." if len(found) > PREFIX_CANDIDATES else ""
        raise CliError(f"job id prefix {value!r} is ambiguous: {', '.join(found[:PREFIX_CANDIDATES])}{more}")
    return found[0]


def _leases(ctx: click.Context):
    app = ctx.find_root().obj.app
    leases = getattr(app, "lease", None)
    if leases is None:
        raise CliError(f"the app {app.main!r} has no CeleryLease (create CeleryLease(app) in it)")
    return leases


def _boundary(fn: Callable) -> Callable:
    """Turn celery-lease's own errors into the one-line exit."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except LeaseError as exc:
            raise CliError(str(exc)) from None
        except sa_exc.ProgrammingError as exc:
            # Our statements are fixed; one the database refuses means its tables are
            # missing or older than this version of celery-lease.
            raise CliError(
                f"the job database lacks celery-lease's tables or columns "
                f"(run: celery -A <app> lease migrate): {type(exc.orig).__name__}"
            ) from None

    return wrapper


json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")


@click.group(help="Durable leased jobs: inspect, cancel, maintain, serve the API.")
@click.pass_context
def lease(ctx: click.Context) -> None:
    # Store warnings (e.g. the driver's reason a connection failed) would otherwise
    # reach stderr through logging's last-resort handler beside our one line.
    if not logging.getLogger().handlers:
        logging.getLogger("celery_lease").addHandler(logging.NullHandler())
