"""Signing in and out, the job list and one job's page.

The list is keyset-paged newest first (the cursor of celery_lease.ops.listing). Each
page reads at most SCAN jobs: when a filter that no index serves (status, kind, queue,
payload field) matches fewer than a page among them, the page says so and its "older"
link continues the search from where it stopped, so no page costs more as the table
grows.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, Response

from celery_lease.job import attempt_history, parse_job_id
from celery_lease.ops import listing
from celery_lease.ops.dashboard import filters
from celery_lease.ops.dashboard.access import COOKIE, SESSION_SECONDS, Viewer, csrf_ok
from celery_lease.ops.dashboard.web import Board, PageError, form, job_id, redirect
from celery_lease.ops.keys import KeyLabels
from celery_lease.ops.throttle import retry_after
from celery_lease.status import TERMINAL, AttemptOutcome, Event, Status

PAGE = 50
#: Jobs one page of the list reads at most.
SCAN = 10_000
#: Characters of a payload or result shown on a job's page.
SHOW_CHARS = 20_000
MAX_EVENTS = 500
#: Finished jobs are counted over this window (the finished index; never the history).
COUNT_WINDOW = 3600
RETRYABLE = (Status.FAILED.value, Status.EXPIRED.value, Status.CANCELLED.value)
#: Events that end an attempt by taking its lease away.
LEASE_LOSSES = (Event.REAPED.value, Event.REQUEUED.value)
#: Attempt-log outcomes of an attempt whose lease was taken away.
LOST_OUTCOMES = (AttemptOutcome.LEASE_EXPIRED.value, AttemptOutcome.INTERRUPTED.value)
#: Events that end an attempt (``dispatched`` and ``claimed`` do not).
ENDINGS = frozenset(e.value for e in Event) - {Event.DISPATCHED.value, Event.CLAIMED.value}


def kind_counts(data: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per kind: pending (due or queued), held, running, and the terminal
    statuses reached within COUNT_WINDOW."""
    rows: dict[str, dict[str, Any]] = {}

    def row(kind: str) -> dict[str, Any]:
        return rows.setdefault(kind, {"kind": kind, "pending": 0, "held": 0, "running": 0, **{s.value: 0 for s in TERMINAL}})

    for r in data["active"]:
        state = "held" if r["held"] is not None else r["status"]
        row(r["kind"])[state] += r["n"]
    for r in data["terminal"]:
        row(r["kind"])[r["status"]] += r["n"]
    return sorted(rows.values(), key=lambda r: r["kind"])


def shown_json(text: str | None, chars: int | None) -> dict[str, Any] | None:
    """A stored JSON value for the page: pretty when whole, else cut, with its size."""
    if text is None:
        return None
    whole = chars is not None and chars <= len(text)
    if whole:
        try:
            text = json.dumps(json.loads(text), indent=2, ensure_ascii=False)
        except ValueError:
            pass
    return {"text": text, "chars": chars, "cut": not whole}


def attempts_of(job: dict[str, Any], events: list[dict[str, Any]], *, show_worker: bool) -> list[dict[str, Any]]:
    """The attempts of a job: its attempt log (every job claimed since migration 0011),
    else its run events, else its row's current attempt."""
    out = _from_log(job, events) or _from_events(job, events)
    if not show_worker:
        for entry in out:
            entry["worker"] = None
    return out


def _from_log(job: dict[str, Any], events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The attempt log, each ended attempt with the detail of the run event that ended
    it (a job of a run: why it was retried, failed, requeued). The worker is the whole
    lease owner (node/pid/boot), as a claimed event's detail: the process to look for."""
    endings: dict[int, list[str | None]] = {}
    for e in events:
        if e["event"] in ENDINGS:
            endings.setdefault(e["attempt"], []).append(e["detail"])
    out = []
    log = job.get("attempts") or []
    for raw, a in zip(log, attempt_history(log)):
        ended = a["ended_at"] is not None and endings.get(a["attempt"])
        out.append(
            {
                "attempt": a["attempt"],
                "worker": raw["owner"],
                "start": a["started_at"],
                "end": a["ended_at"],
                "outcome": a["outcome"],
                "detail": ended.pop(0) if ended else None,
                "lease_losses": int(a["outcome"] in LOST_OUTCOMES),
            }
        )
    return out


def _from_events(job: dict[str, Any], events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A job claimed before the attempt log: from its run events (claimed opens an
    attempt; the next event of that attempt closes it), else from its row."""
    out: list[dict[str, Any]] = []
    by_attempt: dict[int, dict[str, Any]] = {}
    for e in events:
        if e["event"] == Event.CLAIMED.value:
            opened = {"attempt": e["attempt"], "worker": e["detail"], "start": e["created_at"], "end": None}
            opened.update(outcome="running", detail=None, lease_losses=0)
            by_attempt[e["attempt"]] = opened
            out.append(opened)
            continue
        entry = by_attempt.get(e["attempt"])
        if entry is None or entry["end"] is not None or e["event"] not in ENDINGS:
            continue
        entry.update(end=e["created_at"], outcome=e["event"], detail=e["detail"])
        entry["lease_losses"] += e["event"] in LEASE_LOSSES
    if not out and job["attempt"] > 0:
        final = job["status"] if job["status"] != Status.PENDING.value else "requeued"
        out.append(
            {
                "attempt": job["attempt"],
                "worker": job["lease_owner"],
                "start": job["started_at"],
                "end": job["finished_at"],
                "outcome": final,
                "detail": None,
                "lease_losses": job["lease_losses"],
            }
        )
    return out


def register(app: FastAPI, board: Board, labels: KeyLabels) -> None:
    """Sign-in, the list and a job's page; a job's concurrency key (payload text) is
    shown as ``labels`` to a viewer who may not read payloads."""

    @app.get("/", include_in_schema=False)
    def home(request: Request, viewer: Viewer = Depends(board.viewer)):
        return redirect(request, "/jobs")

    @app.get("/login", response_class=HTMLResponse)
    def login_form(request: Request):
        return board.render(request, "login.html", None, error=None)

    secure_cookie = board.leases.settings.dashboard_secure_cookie

    @app.post("/login")
    async def login(request: Request):
        # Failed sign-ins spend the address's and everyone's budget, successful ones the
        # address's sign-in budget (throttle.Gate): once either is spent, a token is not
        # even compared, so a right guess is no faster to find.
        address = request.client.host if request.client else ""

        def too_many(wait: float) -> Response:
            refused = board.render(request, "login.html", None, status=429, error="Too many sign-ins: wait a moment.")
            refused.headers["Retry-After"] = retry_after(wait)
            return refused

        wait = max(board.gate.locked(address), board.gate.sign_ins_wait(address))
        if wait:
            return too_many(wait)
        fields = await form(request, None, action=False)  # 403 from another site's page
        holder = board.sessions.holder(fields.get("token", ""))
        if holder is None:
            board.gate.attempted(address, False)
            return board.render(request, "login.html", None, status=401, error="Unknown token.")
        wait = board.gate.signed_in(address)
        if wait:
            return too_many(wait)
        cookie = board.sessions.open(holder)
        response = redirect(request, "/jobs")
        response.set_cookie(
            COOKIE,
            cookie,
            max_age=SESSION_SECONDS,
            path=(request.scope.get("root_path") or "/"),
            httponly=True,
            samesite="strict",
            # The scheme is https behind a TLS proxy only with serve --proxy-headers.
            secure=secure_cookie or request.url.scheme == "https",
        )
        return response

    @app.post("/logout")
    async def logout(request: Request, viewer: Viewer = Depends(board.viewer)):
        fields = await form(request, viewer, action=False)
        if not csrf_ok(viewer, fields.get("csrf")):
            raise PageError(403, "the form's CSRF token is missing or stale")
        board.sessions.sign_out(request.cookies.get(COOKIE))
        response = redirect(request, "/login")
        response.delete_cookie(COOKIE, path=(request.scope.get("root_path") or "/"))
        return response

    @app.get("/jobs", response_class=HTMLResponse)
    def jobs(request: Request, viewer: Viewer = Depends(board.viewer)) -> Response:
        params = dict(request.query_params)
        search = (params.pop("q", "") or "").strip()
        if search:
            found = None
            try:
                found = board.store.job(parse_job_id(search), tenant=viewer.tenant, cap=1)
            except ValueError:
                pass
            if found is None:
                raise PageError(404, f"no job with the id {search[:64]!r}")
            return redirect(request, f"/jobs/{found['id']}")
        try:
            f = filters.parse(params, tenant=viewer.tenant, payloads=viewer.sees_payloads)
            after = listing.decode_cursor(params.get("cursor") or None)
        except ValueError as exc:
            raise PageError(400, str(exc)) from None
        rows, end = board.store.page(f, after=after, scan=SCAN, limit=PAGE, may_lag=True)
        more = len(rows) > PAGE
        rows = rows[:PAGE]
        older = listing.encode_cursor(rows[-1]) if more else None
        if not more and end is not None:
            older = listing.encode_cursor({"created_at": end[0], "id": end[1]})
        counts = kind_counts(board.store.counts(tenant=viewer.tenant, window=COUNT_WINDOW))
        return board.render(
            request,
            "jobs.html",
            viewer,
            jobs=rows,
            counts=counts,
            statuses=[s.value for s in Status],
            form=filters.form_values(f),
            older=filters.query_string(f, cursor=older) if older else None,
            short=not more and end is not None,
            filtered=filters.query_string(f),
            scan=SCAN,
            window_minutes=COUNT_WINDOW // 60,
            first_page=after is None,
        )

    @app.get("/jobs/{job}", response_class=HTMLResponse)
    def job_page(request: Request, job: str, viewer: Viewer = Depends(board.viewer)) -> Response:
        row = board.store.job(job_id(job), tenant=viewer.tenant, cap=SHOW_CHARS, payloads=viewer.sees_payloads)
        if row is None:
            raise PageError(404, "no such job")
        row["concurrency_key"] = labels.shown(row["concurrency_key"], payloads=viewer.sees_payloads)
        # A tenant sees neither the worker hosts nor the events of other tenants.
        show_worker = viewer.tenant is None
        events = board.store.job_events(row["id"], MAX_EVENTS)
        run_events = board.store.run_events(row["run_id"], tenant=viewer.tenant, limit=MAX_EVENTS) if row["run_id"] else []
        if not show_worker:
            for e in run_events:
                if e["event"] == Event.CLAIMED.value:
                    e["detail"] = None
        return board.render(
            request,
            "job.html",
            viewer,
            job=row,
            payload=shown_json(row["payload_text"], row["payload_chars"]),  # None unless the viewer may read it
            result=shown_json(row["result_text"], row["result_chars"]),
            progress=None if row["progress"] is None else json.dumps(row["progress"], indent=2, ensure_ascii=False)[:SHOW_CHARS],
            attempts=attempts_of(row, events, show_worker=show_worker),
            run_events=run_events,
            show_worker=show_worker,
            can_cancel=row["status"] in (Status.PENDING.value, Status.RUNNING.value),
            can_retry=row["status"] in RETRYABLE,
            can_delete=Status(row["status"]).terminal,
        )
