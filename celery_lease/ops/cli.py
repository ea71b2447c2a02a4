"""``celery -A proj lease ...``: operate celery-lease from Celery's own CLI.

Installed through the ``celery.commands`` entry point, so it runs with the app Celery
loaded from ``-A`` and finds the CeleryLease instance at ``app.lease``::

    celery -A proj lease migrate                 upgrade the job tables
    celery -A proj lease show ID [--json]        one job (ID: or a unique prefix, >= 8 hex digits)
    celery -A proj lease list [--status S] [--kind K] [--queue Q] [--limit N] [--cursor C] [--json]
    celery -A proj lease cancel ID [--json]      exit 1 when the job had already finished
    celery -A proj lease cancel-run RUN [--json]
    celery -A proj lease reap | sweep [--json]   what beat runs, once, now
    celery -A proj lease prune [--older-than SECONDS] [--json]
    celery -A proj lease pause KIND | resume KIND [--json]   flow control (stored, fleet-wide)
    celery -A proj lease limits [--json]         per kind and key: limits, running, waiting
    celery -A proj lease limit KIND [--concurrency N|none|default] [--rate R|none|default] [--json]
    celery -A proj lease serve [--host H] [--port P] [--proxy-headers [--forwarded-allow-ips IPS]]
                                                       the HTTP API and dashboard (celery_lease.ops.api)

Errors (unknown or malformed id, bad status, unreachable database, bad configuration)
print exactly one line, ``celery-lease: <what is wrong>``, on stderr and exit non-zero:
2 for input refused before anything was read, 1 otherwise. Never a traceback: the
database driver's message (which can carry a host or a password) stays out of it.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import logging
import re
from collections.abc import Callable
from datetime import datetime
from typing import Any

import click
from sqlalchemy import exc as sa_exc

from celery_lease.errors import LeaseError, UnknownKind
from celery_lease.flow.limits import LimitChange
from celery_lease.job import Job, parse_job_id
from celery_lease.ops import listing
from celery_lease.status import Status

#: Columns of ``lease list``: (heading, how to show it).
LIST_COLUMNS: tuple[tuple[str, Callable[[Job], str]], ...] = (
    ("ID", lambda j: j.id),
    ("KIND", lambda j: printable(j.kind)),
    ("STATUS", lambda j: j.status.value),
    ("ATTEMPT", lambda j: f"{j.attempt}/{j.max_attempts}"),
    ("PROGRESS", lambda j: "" if j.progress is None else printable(_short(json.dumps(j.progress, separators=(",", ":"))))),
    ("CREATED", lambda j: _when(j.created_at)),
    ("FINISHED", lambda j: _when(j.finished_at)),
    ("ERROR", lambda j: printable((j.error or "")[:60])),
)


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


@lease.command(help="Apply the shipped migrations up to the latest revision.")
@click.pass_context
@_boundary
def migrate(ctx: click.Context) -> None:
    leases = _leases(ctx)
    revision = leases.create_schema()
    click.echo(f"celery-lease schema at revision {revision} ({printable(leases.store.display_url)})")


@lease.command(help="Show one job (by its id, or a unique prefix of 8 or more hex digits).")
@click.argument("job_id")
@json_option
@click.pass_context
@_boundary
def show(ctx: click.Context, job_id: str, as_json: bool) -> None:
    leases = _leases(ctx)
    job_id = _id_or_prefix(leases, job_id)
    job = leases.store.get(job_id)
    if job is None:
        raise CliError(f"no job {job_id}")
    data = job.to_dict()
    width = max(len(k) for k in data)
    # JSON values are shown as JSON (json.dumps escapes control characters); text is
    # escaped by printable(). The attempts follow, one line each.
    text = "\n".join(
        f"{k.ljust(width)}  {json.dumps(v) if isinstance(v, (dict, list)) else ('' if v is None else printable(str(v)))}"
        for k, v in data.items()
        if k != "attempts"
    )
    for a in data["attempts"]:
        ended = a["ended_at"] or "(running)"
        text += f"\n  attempt {a['attempt']}  {printable(a['worker'])}  {a['started_at']} -> {ended}  {a['outcome']}"
    _emit(as_json, data, text)


@lease.command("list", help="List jobs, newest first.")
@click.option(
    "--status",
    default=None,
    help="pending, running, succeeded, failed, expired or cancelled (or Celery's PENDING, STARTED, SUCCESS, FAILURE, REVOKED).",
)
@click.option("--kind", default=None, help="Only jobs of this kind.")
@click.option("--queue", default=None, help="Only jobs Celery routed to this queue.")
@click.option("--limit", default=str(listing.DEFAULT_LIMIT), show_default=True, help=f"Jobs per page (1-{listing.MAX_LIMIT}).")
@click.option("--cursor", default=None, help="The next-page cursor printed by a previous list.")
@json_option
@click.pass_context
@_boundary
def list_(
    ctx: click.Context, status: str | None, kind: str | None, queue: str | None, limit: str, cursor: str | None, as_json: bool
) -> None:
    try:
        query = listing.Query.parse(status=_status(status), kind=kind, limit=limit, cursor=cursor, queue=queue)
    except ValueError as exc:
        raise CliError(str(exc), exit_code=2) from None
    leases = _leases(ctx)
    page = listing.list_page(leases, query)
    if kind is not None and not page.jobs and query.after is None:
        try:  # a kind no handler declares and no job has: a typo, not an empty list
            leases.resolve(kind)
        except UnknownKind as exc:
            raise CliError(str(exc), exit_code=2) from None
    data = {"jobs": [j.to_dict() for j in page.jobs], "next_cursor": page.next_cursor}
    text = _table([h for h, _ in LIST_COLUMNS], [[cell(j) for _, cell in LIST_COLUMNS] for j in page.jobs])
    if page.next_cursor:
        text += f"\nmore: --cursor {page.next_cursor}"
    _emit(as_json, data, text)


@lease.command(help="Cancel a pending or running job (exit 1 if it had already finished).")
@click.argument("job_id")
@json_option
@click.pass_context
@_boundary
def cancel(ctx: click.Context, job_id: str, as_json: bool) -> None:
    job_id = _id(job_id)
    leases = _leases(ctx)
    if leases.store.get(job_id) is None:
        raise CliError(f"no job {job_id}")
    cancelled = leases.cancel(job_id)
    job = leases.store.get(job_id)
    status = job.status.value if job is not None else "pruned"
    if not cancelled:
        raise CliError(f"job {job_id} had already finished ({status}); nothing cancelled")
    _emit(as_json, {"id": job_id, "cancelled": True, "status": status}, f"cancelled {job_id}")


@lease.command("cancel-run", help="Cancel every unfinished job of a run; the run accepts no new jobs.")
@click.argument("run_id")
@json_option
@click.pass_context
@_boundary
def cancel_run(ctx: click.Context, run_id: str, as_json: bool) -> None:
    run_id = _id(run_id, "run")
    count = _leases(ctx).cancel_run(run_id)
    _emit(as_json, {"run_id": run_id, "cancelled": count}, f"cancelled {count} job(s) of run {run_id}")


@lease.command(help="Requeue or expire jobs whose lease elapsed (what beat runs).")
@json_option
@click.pass_context
@_boundary
def reap(ctx: click.Context, as_json: bool) -> None:
    counts = _leases(ctx).reap()
    _emit(as_json, counts, ", ".join(f"{k}: {v}" for k, v in counts.items()))


@lease.command(help="Re-send wakeups for due pending jobs (what beat runs).")
@json_option
@click.pass_context
@_boundary
def sweep(ctx: click.Context, as_json: bool) -> None:
    sent = _leases(ctx).sweep()
    _emit(as_json, {"sent": sent}, f"sent {sent} wakeup(s)")


@lease.command(help="Delete finished jobs (and their events) older than the retention.")
@click.option(
    "--older-than", "older_than", default=None, help="Seconds since the job finished (default: lease_retention_seconds)."
)
@json_option
@click.pass_context
@_boundary
def prune(ctx: click.Context, older_than: str | None, as_json: bool) -> None:
    age = None
    if older_than is not None:
        try:
            age = float(older_than)
        except ValueError:
            age = -1.0
        if not 0 <= age < float("inf"):
            raise CliError(f"--older-than must be a number of seconds >= 0, not {older_than[:40]!r}", 2)
    deleted = _leases(ctx).prune(age)
    _emit(as_json, {"deleted": deleted}, f"deleted {deleted} finished job(s)")


def _flow_call(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except UnknownKind as exc:  # refused before anything was read or written
        raise CliError(str(exc), exit_code=2) from None


@lease.command(help="Claim no job of KIND until resumed (stored: survives restarts); running jobs finish.")
@click.argument("kind")
@json_option
@click.pass_context
@_boundary
def pause(ctx: click.Context, kind: str, as_json: bool) -> None:
    paused = _flow_call(lambda: _leases(ctx).pause(kind))
    text = f"paused {kind}" if paused else f"{kind} was already paused"
    _emit(as_json, {"kind": kind, "paused": True, "changed": paused}, text)


@lease.command(help="Claim KIND again and wake every job its pause held.")
@click.argument("kind")
@json_option
@click.pass_context
@_boundary
def resume(ctx: click.Context, kind: str, as_json: bool) -> None:
    woken = _flow_call(lambda: _leases(ctx).resume(kind))
    _emit(as_json, {"kind": kind, "paused": False, "woken": woken}, f"resumed {kind}: woke {woken} held job(s)")


#: Columns of ``lease limits``: (heading, key of flow.FlowControl.overview's rows).
LIMIT_COLUMNS = (
    ("KIND", "kind"),
    ("KEY", "key"),
    ("CONCURRENCY", "concurrency"),
    ("RATE", "rate_limit"),
    # Where each limit in force comes from: "code" (@leases.job) or "override".
    ("CONCURRENCY_FROM", "concurrency_source"),
    ("RATE_FROM", "rate_limit_source"),
    ("PAUSED", "paused"),
    ("RUNNING", "running"),
    ("WAIT_LIMIT", "waiting_limit"),
    ("WAIT_RATE", "waiting_rate"),
    ("WAIT_PAUSE", "waiting_pause"),
    ("PENDING", "pending"),
)


@lease.command(help="Per kind and key: limits, pause, and how many jobs run or wait on each.")
@json_option
@click.pass_context
@_boundary
def limits(ctx: click.Context, as_json: bool) -> None:
    rows = _leases(ctx).limits()

    def cell(value: Any) -> str:
        # A key is payload text: escaped like every stored value shown on a terminal.
        return "yes" if value is True else "" if value is None or value is False else printable(str(value))

    text = _table([h for h, _ in LIMIT_COLUMNS], [[cell(r[k]) for _, k in LIMIT_COLUMNS] for r in rows])
    _emit(as_json, {"kinds": rows}, text)


@lease.command(
    help="Change KIND's limits for every worker (stored; obeyed within seconds). Each option: a limit, "
    "'none' (no limit, whatever the code declares) or 'default' (what the code declares); one left out is unchanged."
)
@click.argument("kind")
@click.option("--concurrency", metavar="N|none|default", help="jobs of one concurrency key running at once")
@click.option("--rate", metavar="R|none|default", help="claims per window, as rate_limit: 10/s, 100/m, 1000/h")
@json_option
@click.pass_context
@_boundary
def limit(ctx: click.Context, kind: str, concurrency: str | None, rate: str | None, as_json: bool) -> None:
    try:
        change = LimitChange.parse(concurrency=concurrency, rate=rate, given=(concurrency is not None, rate is not None))
    except ValueError as exc:
        raise CliError(str(exc), exit_code=2) from None
    try:
        leases = _leases(ctx)
        leases.import_task_modules()  # the kinds the workers declare, not only those imported here
        now = _flow_call(lambda: leases.flow.set_limits(kind, change))
    except ValueError as exc:  # a batched kind: refused before anything was written
        raise CliError(str(exc), exit_code=2) from None

    def shown(label: str, key: str) -> str:
        return f"{label} {now[key] or 'none'} (from {now[key + '_source']})"

    text = f"{printable(kind)}: {shown('concurrency', 'concurrency')}, {shown('rate', 'rate_limit')}"
    _emit(as_json, {"kind": kind, **now}, text)


def _peers(value: str | None) -> str | None:
    """--forwarded-allow-ips: ``*`` or comma-separated addresses and networks."""
    if value is None:
        return None
    if value.strip() == "*":
        return "*"
    peers = [p.strip() for p in value.split(",")]
    for peer in peers:
        try:
            ipaddress.ip_network(peer, strict=False)
        except ValueError:
            raise CliError(f"--forwarded-allow-ips: {printable(peer[:60])!r} is not an address or network", 2) from None
    return ",".join(peers)


@lease.command(help="Serve the HTTP API and the dashboard (needs the api extra).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option(
    "--proxy-headers",
    is_flag=True,
    help="Believe X-Forwarded-For/-Proto (the client address sign-ins are throttled by, "
    "https for Secure cookies) from the --forwarded-allow-ips peers only; off: from nobody.",
)
@click.option(
    "--forwarded-allow-ips",
    default=None,
    metavar="IPS",
    help="With --proxy-headers: the proxies' addresses or networks, comma-separated, or * [default: 127.0.0.1].",
)
@click.pass_context
@_boundary
def serve(ctx: click.Context, host: str, port: int, proxy_headers: bool, forwarded_allow_ips: str | None) -> None:
    peers = _peers(forwarded_allow_ips)
    if peers is not None and not proxy_headers:
        raise CliError("--forwarded-allow-ips needs --proxy-headers", 2)
    leases = _leases(ctx)
    try:
        from celery_lease.ops import api
    except ImportError:
        raise CliError("the HTTP API needs the api extra: pip install 'celery-lease[api]'") from None
    leases.store.ping()  # refuse to start against a database that does not answer
    leases.store.ping_lagging()  # nor against a replica (lease_read_database_url) that does not
    # From here on the server's log is the place for the store's warnings.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    api.serve(leases, host, port, proxy_headers=proxy_headers, forwarded_allow_ips=peers or "127.0.0.1")
