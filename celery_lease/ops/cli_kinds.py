"""``celery lease pause | resume | limits | limit | tenants | weight``: flow control and
fair share, stored and fleet-wide (docs/flow-control.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from celery_lease.errors import UnknownKind
from celery_lease.flow.fair import FairShare
from celery_lease.flow.limits import LimitChange
from celery_lease.ops.cli_common import CliError, _boundary, _emit, _leases, _table, json_option, lease, printable


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
    leases = _leases(ctx)
    leases.import_task_modules()  # the kinds the workers declare, not only those imported here
    now = _flow_call(lambda: leases.flow.set_limits(kind, change))

    def shown(label: str, key: str) -> str:
        return f"{label} {now[key] or 'none'} (from {now[key + '_source']})"

    text = f"{printable(kind)}: {shown('concurrency', 'concurrency')}, {shown('rate', 'rate_limit')}"
    _emit(as_json, {"kind": kind, **now}, text)


def _share(value: Any) -> str:
    return "" if value is None else f"{value:.0%}"


@lease.command(help="Per tenant: its weight in fair kinds, its pending and running fair jobs, and its share.")
@json_option
@click.pass_context
@_boundary
def tenants(ctx: click.Context, as_json: bool) -> None:
    rows = FairShare(_leases(ctx).store).tenants()
    cells = [
        [
            "(none)" if r["tenant"] is None else printable(r["tenant"]),
            f"{r['weight']:g}",
            str(r["pending"]),
            str(r["running"]),
            _share(r["share"]),
        ]
        for r in rows
    ]
    _emit(as_json, {"tenants": rows}, _table(["TENANT", "WEIGHT", "PENDING", "RUNNING", "SHARE"], cells))


@lease.command(
    help="Set TENANT's weight in every fair kind (stored; obeyed by the next claims of every worker): "
    "a positive number, or 'default' (1). A tenant of weight 3 is given three claims for one of a tenant of weight 1.",
    context_settings={"ignore_unknown_options": True},  # "-1" is a weight to refuse, not an option
)
@click.argument("tenant")
@click.argument("weight", metavar="N|default")
@json_option
@click.pass_context
@_boundary
def weight(ctx: click.Context, tenant: str, weight: str, as_json: bool) -> None:
    try:
        row = FairShare(_leases(ctx).store).set_weight(tenant, weight)
    except ValueError as exc:  # refused before anything was written
        raise CliError(str(exc), exit_code=2) from None
    _emit(as_json, row, f"{printable(tenant)}: weight {row['weight']:g}")
