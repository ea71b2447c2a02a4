"""The fleet's pages: kinds (flow control), live throughput and latency, workers and
leases, and reconciliation between the job table and the broker.

Every figure comes from a bounded read (see celery_lease.db.statements.dashboard): the
live set of pending and running jobs, or a recent window of submits and finishes.
"""

from __future__ import annotations

import json
import logging
import math
from datetime import timedelta
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from celery_lease.errors import UnknownKind
from celery_lease.flow.fair import FairShare
from celery_lease.flow.limits import LimitChange
from celery_lease.ops.dashboard.access import Viewer
from celery_lease.ops.dashboard.web import Board, PageError, form, redirect
from celery_lease.ops.keys import KeyLabels

log = logging.getLogger("celery_lease.dashboard")

#: The live page's window, and the rows of each kind it reads at most.
LIVE_MINUTES = 15
LIVE_CAP = 20_000
LEASES_SHOWN = 500
STALE_SHOWN = 100
#: Unswept jobs are counted up to this many ("10,000+").
COUNT_CAP = 10_000
#: Wakeups read from the head of each broker queue to check against the table.
PEEK = 1000
_BARS = "▁▂▃▄▅▆▇█"


def percentile(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile of ``values`` (None when empty)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(p / 100 * len(ordered)) - 1))]


def spark(values: list[int]) -> str:
    top = max(values) if values else 0
    return "".join(_BARS[0] if not top else _BARS[min(7, v * 8 // (top + 1))] for v in values)


def live_figures(data: dict[str, Any], minutes: int = LIVE_MINUTES) -> dict[str, Any]:
    """Per kind: submitted / succeeded / failed in each of the last ``minutes``
    minutes, and p50/p95 of queue wait (submit to start of the last attempt) and run
    time (that start to finish) over the window."""
    first = data["minute"] - minutes + 1
    start = data["now"].replace(second=0, microsecond=0) - timedelta(minutes=minutes - 1)
    labels = [(start + timedelta(minutes=i)).strftime("%H:%M") for i in range(minutes)]
    kinds: dict[str, dict[str, Any]] = {}

    def of(kind: str) -> dict[str, Any]:
        if kind not in kinds:
            kinds[kind] = {"kind": kind, **{k: [0] * minutes for k in ("submitted", "succeeded", "failed")}, "w": [], "r": []}
        return kinds[kind]

    for kind, minute, count in data["submits"]:
        if 0 <= minute - first < minutes:
            of(kind)["submitted"][minute - first] += count
    for kind, status, minute, wait, run in data["finishes"]:
        k = of(kind)
        if status in ("succeeded", "failed") and 0 <= minute - first < minutes:
            k[status][minute - first] += 1
        if wait is not None:
            k["w"].append(wait)
            k["r"].append(run)
    out = []
    for k in sorted(kinds.values(), key=lambda k: k["kind"]):
        waits, runs = k.pop("w"), k.pop("r")
        k.update(
            wait_p50=percentile(waits, 50),
            wait_p95=percentile(waits, 95),
            run_p50=percentile(runs, 50),
            run_p95=percentile(runs, 95),
            spark={name: spark(k[name]) for name in ("submitted", "succeeded", "failed")},
        )
        out.append(k)
    capped = sum(c for _, _, c in data["submits"]) >= LIVE_CAP or len(data["finishes"]) >= LIVE_CAP
    return {"now": data["now"].isoformat(), "minutes": labels, "kinds": out, "capped": capped}


def broker_queues(board: Board, names: list[str]) -> dict[str, dict[str, Any]]:
    """Per queue: messages waiting in the broker, and, on Redis, how many of the first
    PEEK wake a job that is terminal or missing. Values are None when the broker cannot
    tell (unreachable, or a queue no worker declared)."""
    app = board.leases.app
    out: dict[str, dict[str, Any]] = {n: {"length": None, "orphans": None, "peeked": 0} for n in names}
    try:
        with app.connection_for_read(connect_timeout=2) as conn:
            channel = conn.default_channel
            client = getattr(channel, "client", None)  # kombu's Redis channel
            for name in names:
                try:
                    if client is not None:
                        out[name]["length"] = client.llen(name)
                        ids = [json.loads(m)["headers"]["id"] for m in client.lrange(name, -PEEK, -1)]
                        states = board.store.job_states(ids)
                        out[name]["peeked"] = len(ids)
                        out[name]["orphans"] = sum(1 for i in ids if states.get(i) not in ("pending", "running"))
                    else:
                        out[name]["length"] = channel.queue_declare(queue=name, passive=True).message_count
                except Exception:  # a queue the broker does not know, or a foreign message
                    log.debug("celery-lease: cannot read broker queue %s", name, exc_info=True)
    except Exception as exc:
        log.warning("celery-lease: dashboard cannot reach the broker (%s)", type(exc).__name__)
    return out


def register(app: FastAPI, board: Board, labels: KeyLabels) -> None:
    """The fleet's routes; concurrency keys (payload text) are shown as ``labels`` to a
    viewer who may not read payloads."""
    leases = board.leases
    fair = FairShare(leases.store)

    @app.get("/kinds", response_class=HTMLResponse)
    def kinds(request: Request, viewer: Viewer = Depends(board.viewer)) -> Response:
        rows = labels.rows(leases.limits(tenant=viewer.tenant), "key", payloads=viewer.sees_payloads)
        # A rate budget counts every tenant's claims: a tenant's token sees none.
        budgets = board.store.rate_budgets() if viewer.tenant is None else {}
        for i, r in enumerate(rows):  # the kind's pause button goes on its first row
            r["first"] = i == 0 or rows[i - 1]["kind"] != r["kind"]
            r["budget"] = budgets.get(r["kind"]) if r["rate_limit"] and r["first"] else None
        # Fair share per tenant: a tenant's token sees its own row only.
        tenants = [t for t in fair.tenants() if viewer.tenant is None or t["tenant"] == viewer.tenant]
        return board.render(request, "kinds.html", viewer, rows=rows, tenants=tenants)

    async def flow(request: Request, viewer: Viewer, kind: str, pause: bool) -> Response:
        await form(request, viewer)
        if viewer.tenant is not None:
            raise PageError(403, "a tenant's token cannot pause or resume a kind shared with other tenants")
        try:
            leases.pause(kind) if pause else leases.resume(kind)
        except UnknownKind as exc:
            raise PageError(404, str(exc)) from None
        return redirect(request, "/kinds")

    @app.post("/kinds/{kind}/pause")
    async def pause(request: Request, kind: str, viewer: Viewer = Depends(board.viewer)) -> Response:
        return await flow(request, viewer, kind, True)

    @app.post("/kinds/{kind}/resume")
    async def resume(request: Request, kind: str, viewer: Viewer = Depends(board.viewer)) -> Response:
        return await flow(request, viewer, kind, False)

    @app.post("/kinds/{kind}/limits")
    async def limits(request: Request, kind: str, viewer: Viewer = Depends(board.viewer)) -> Response:
        """The Kinds page's limits form: each field left blank is unchanged; a limit,
        'none' (no limit) or 'default' (what the code declares) sets it for the fleet."""
        fields = await form(request, viewer)
        if viewer.tenant is not None:
            raise PageError(403, "a tenant's token cannot change limits that bind every tenant's jobs")
        concurrency, rate = (fields.get(name, "").strip() for name in ("concurrency", "rate_limit"))
        try:
            change = LimitChange.parse(concurrency=concurrency, rate=rate, given=(bool(concurrency), bool(rate)))
            leases.import_task_modules()  # the kinds the workers declare, not only those imported here
            leases.flow.set_limits(kind, change)
        except UnknownKind as exc:
            raise PageError(404, str(exc)) from None
        except ValueError as exc:
            raise PageError(400, str(exc)) from None
        return redirect(request, "/kinds")

    @app.post("/tenants/{tenant}/weight")
    async def weight(request: Request, tenant: str, viewer: Viewer = Depends(board.viewer)) -> Response:
        """The Kinds page's weight form: a positive number or 'default' (1), for the fleet."""
        fields = await form(request, viewer)
        if viewer.tenant is not None:
            raise PageError(403, "a tenant's token cannot change weights that share the fleet among tenants")
        try:
            fair.set_weight(tenant, fields.get("weight", "").strip())
        except ValueError as exc:
            raise PageError(400, str(exc)) from None
        return redirect(request, "/kinds")

    @app.get("/live", response_class=HTMLResponse)
    def live(request: Request, viewer: Viewer = Depends(board.viewer)) -> Response:
        return board.render(request, "live.html", viewer, minutes=LIVE_MINUTES)

    @app.get("/live.json")
    def live_json(request: Request, viewer: Viewer = Depends(board.viewer)) -> Response:
        data = board.store.live(tenant=viewer.tenant, window=LIVE_MINUTES * 60, cap=LIVE_CAP)
        return JSONResponse(live_figures(data))

    @app.get("/workers", response_class=HTMLResponse)
    def workers(request: Request, viewer: Viewer = Depends(board.viewer)) -> Response:
        data = board.store.leases(tenant=viewer.tenant, limit=LEASES_SHOWN)
        now = data["now"]
        for r in data["running"]:
            left = (r["lease_expires_at"] - now).total_seconds() if r["lease_expires_at"] else None
            r["left"] = left
            r["renewed_ago"] = None if left is None else r["lease_seconds"] - left
            # Heartbeats renew every lease_seconds / 3: less than that left means at
            # least one renewal was missed; nothing left, the reaper's to take.
            r["state"] = "ok" if left is None or left >= r["lease_seconds"] / 3 else "lapsing" if left >= 0 else "lapsed"
        return board.render(
            request,
            "workers.html",
            viewer,
            now=now,
            running=data["running"],
            owners=data["owners"] if viewer.tenant is None else [],
            shown=LEASES_SHOWN,
            show_worker=viewer.tenant is None,
        )

    @app.get("/reconcile", response_class=HTMLResponse)
    def reconcile(request: Request, viewer: Viewer = Depends(board.viewer)) -> Response:
        stale_seconds = leases.settings.sweep_stale_seconds
        data = board.store.reconciliation(tenant=viewer.tenant, stale_seconds=stale_seconds, limit=STALE_SHOWN, cap=COUNT_CAP)
        default = leases.app.conf.task_default_queue or "celery"
        queues: dict[str, dict[str, Any]] = {}
        for r in data["pending"]:
            q = queues.setdefault(r["queue"] or default, {"queue": r["queue"] or default, "due": 0, "held": 0})
            q["held" if r["held"] else "due"] += r["n"]
        queues.setdefault(default, {"queue": default, "due": 0, "held": 0})
        # Broker queues are shared by every tenant: a tenant's token sees its rows only.
        broker = broker_queues(board, sorted(queues)) if viewer.tenant is None else {}
        for name, q in queues.items():
            q.update(broker.get(name, {"length": None, "orphans": None, "peeked": 0}))
        return board.render(
            request,
            "reconcile.html",
            viewer,
            stale=data["stale"],
            stale_count=data["stale_count"],
            cap=COUNT_CAP,
            stale_seconds=stale_seconds,
            held=labels.rows(data["held"], "concurrency_key", payloads=viewer.sees_payloads),
            queues=sorted(queues.values(), key=lambda q: q["queue"]),
            sent=request.query_params.get("sent"),
        )

    @app.post("/reconcile/sweep")
    async def sweep(request: Request, viewer: Viewer = Depends(board.viewer)) -> Response:
        await form(request, viewer)
        if viewer.tenant is not None:
            raise PageError(403, "a tenant's token cannot sweep every tenant's jobs")
        sent = leases.sweep()
        return redirect(request, f"/reconcile?sent={int(sent)}")
