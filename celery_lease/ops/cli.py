"""``celery -A proj lease ...``: operate celery-lease from Celery's own CLI.

Installed through the ``celery.commands`` entry point (the group and what every command
shares: ops/cli_common.py; the flow-control commands: ops/cli_kinds.py), so it runs with
the app Celery loaded from ``-A`` and finds the CeleryLease instance at ``app.lease``.
The commands: docs/operations.md; a job ID may be a unique prefix of >= 8 hex digits.
The rule: an error (unknown or malformed id, bad status, unreachable database, bad
configuration) prints exactly one line, ``celery-lease: <what is wrong>``, on stderr
and exits non-zero: 2 for input refused before anything was read, 1 otherwise. Never a
traceback: the database driver's message (which can carry a host or a password) stays
out of it.
"""

from __future__ import annotations

import ipaddress
import json
import logging
from collections.abc import Callable

import click

from celery_lease.errors import UnknownKind
from celery_lease.job import Job
from celery_lease.ops import (
    cli_kinds,  # noqa: F401  (registers pause, resume, limits, limit, tenants, weight)
    listing,
)
from celery_lease.ops.cli_common import (
    CliError,
    _boundary,
    _emit,
    _id,
    _id_or_prefix,
    _leases,
    _short,
    _status,
    _table,
    _when,
    json_option,
    lease,
    printable,
)
from celery_lease.ops.retry import NotRetried, retry_as_new

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
#: Characters of a checkpoint ``show`` prints as text (--json prints it whole): one can
#: be megabytes (lease_max_checkpoint_bytes).
SHOW_CHECKPOINT_CHARS = 2000


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
    data = {**job.to_dict(), "checkpoint": leases.store.checkpoint(job_id)}
    width = max(len(k) for k in data)
    # JSON values are shown as JSON (json.dumps escapes control characters); text is
    # escaped by printable(). The attempts follow, one line each.
    text = "\n".join(f"{k.ljust(width)}  {_shown(k, v)}" for k, v in data.items() if k != "attempts")
    for a in data["attempts"]:
        ended = a["ended_at"] or "(running)"
        text += f"\n  attempt {a['attempt']}  {printable(a['worker'])}  {a['started_at']} -> {ended}  {a['outcome']}"
    _emit(as_json, data, text)


def _shown(key: str, value: object) -> str:
    """One field of ``show`` as text; a checkpoint (any JSON value) as JSON, capped."""
    if key == "checkpoint":
        if value is None:
            return ""
        text = json.dumps(value)
        if len(text) > SHOW_CHECKPOINT_CHARS:
            return f"{text[:SHOW_CHECKPOINT_CHARS]}... ({len(text)} characters; --json shows all)"
        return text
    return json.dumps(value) if isinstance(value, (dict, list)) else ("" if value is None else printable(str(value)))


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


@lease.command(help="Submit a failed, expired or cancelled job again as a new job; print its id.")
@click.argument("job_id")
@json_option
@click.pass_context
@_boundary
def retry(ctx: click.Context, job_id: str, as_json: bool) -> None:
    """The API's retry (ops/retry.py): the new job's fencing tokens start above every
    token of the original; a job is retried once (retry the retry to try again)."""
    job_id = _id(job_id)
    try:
        made = retry_as_new(_leases(ctx), job_id)
    except NotRetried as exc:
        raise CliError(str(exc)) from None
    _emit(as_json, {"id": job_id, "job_id": made}, made)


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
        import uvicorn

        from celery_lease.ops import api
    except ImportError:
        raise CliError("the HTTP API needs the api extra: pip install 'celery-lease[api]'") from None
    leases.store.ping()  # refuse to start against a database that does not answer
    leases.store.ping_lagging()  # nor against a replica (lease_read_database_url) that does not
    # From here on the server's log is the place for the store's warnings.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # X-Forwarded-For and -Proto decide the client address the failed-sign-in budget
    # counts and the scheme that makes the session cookie Secure. proxy_headers is
    # passed even when off: uvicorn's own default believes any loopback peer, so every
    # guess through a local proxy could name a new address.
    uvicorn.run(
        api.create_app(leases),
        host=host,
        port=port,
        log_level="info",
        proxy_headers=proxy_headers,
        forwarded_allow_ips=peers or "127.0.0.1",
    )
