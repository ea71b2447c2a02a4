"""Actions on jobs: cancel, retry, delete, one job or everything a filter matches.

The rule: a token may do here what it may do through the API. Every action is a POST
carrying the session's CSRF token, refused (403) to a read-only token before anything is
read, and limited to the viewer's tenant (another tenant's job is a 404); retry is
refused to a tenant's token too, and its buttons are not shown. Retry submits a *new*
job (ops/retry.py, once per job); delete takes a terminal job and its events; cancel a
pending or running one, confirmed on a page of its own (no script: the CSP allows none).
Bulk: ``GET /bulk?action=...&<filter>`` counts the newest BULK_CAP matches among the
newest SCAN jobs and asks for confirmation; the POST selects them again and acts on at
most BULK_CAP, leaving the rest for the next round.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, Response

from celery_lease.db.statements import maintenance
from celery_lease.db.statements.dashboard import Filter
from celery_lease.lifecycle import transition as tr
from celery_lease.ops.dashboard import filters
from celery_lease.ops.dashboard.access import Viewer
from celery_lease.ops.dashboard.pages import RETRYABLE, SCAN
from celery_lease.ops.dashboard.web import Board, PageError, form, job_id, redirect
from celery_lease.ops.retry import NotRetried, retry_as_new
from celery_lease.status import Status

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

    from celery_lease.job import Job

#: Jobs one bulk action changes at most.
BULK_CAP = 1000
ACTIONS = {
    "cancel": (Status.PENDING.value, Status.RUNNING.value),
    "retry": RETRYABLE,
    "delete": tuple(s.value for s in Status if s.terminal),
}


def _selection(board: Board, f: Filter, action: str) -> tuple[list[str], bool]:
    """The ids ``action`` applies to among the filter's newest matches (at most
    BULK_CAP), and whether more may match beyond them."""
    rows, end = board.store.page(f, after=None, scan=SCAN, limit=BULK_CAP)
    eligible = [r["id"] for r in rows if r["status"] in ACTIONS[action]]
    return eligible[:BULK_CAP], len(rows) > BULK_CAP or end is not None


def _action(value: str | None) -> str:
    if value not in ACTIONS:
        raise PageError(400, f"unknown action (one of: {', '.join(ACTIONS)})")
    return value


def _allowed(viewer: Viewer, action: str) -> None:
    """Refuse (403) what the API refuses the viewer's token: every action to a read-only
    token, retry to a tenant's (templates hide the same buttons)."""
    if not viewer.can_act:
        raise PageError(403, "this token is read-only: it can look, not act")
    if action == "retry" and viewer.tenant is not None:
        raise PageError(403, "retry needs a token bound to no tenant (as the API's retry)")


class Acts:
    """What an action does, on ids the viewer may see."""

    def __init__(self, board: Board, viewer: Viewer) -> None:
        self.board, self.viewer = board, viewer

    def cancel(self, ids: list[str]) -> int:
        return sum(bool(self.board.leases.cancel(i)) for i in ids)

    def retry(self, ids: list[str]) -> list[str]:
        """The ids of the new jobs retrying those of ``ids`` that ended otherwise than by
        success and were not retried before (ops.retry, as the API's retry)."""
        _allowed(self.viewer, "retry")
        made = []
        for old in ids:
            try:
                made.append(retry_as_new(self.board.leases, old, tenant=self.viewer.tenant))
            except NotRetried:  # moved on since it was selected, or retried before
                continue
        return made

    def delete(self, ids: list[str]) -> int:
        """Delete the ended jobs among ``ids`` with their events (the ``delete`` transition)."""
        if not ids:
            return 0
        build = {"ids": ids, "tenant": self.viewer.tenant}
        return len(self.board.leases.lifecycle.execute(tr.DELETE, build=build, during=_DeletedEvents()))


class _DeletedEvents:
    """The ``delete`` transition's own part: the deleted jobs' run events go with them."""

    def write(self, conn: Connection, rows: Sequence[Mapping[str, Any]]) -> list[Job]:
        if rows:
            conn.execute(maintenance.delete_job_events([str(r["id"]) for r in rows]))
        return []

    def send(self) -> None:
        pass


def register(app: FastAPI, board: Board) -> None:
    def visible(job: str, viewer: Viewer) -> dict[str, Any]:
        row = board.store.job(job_id(job), tenant=viewer.tenant, cap=1)
        if row is None:
            raise PageError(404, "no such job")
        return row

    @app.get("/jobs/{job}/cancel", response_class=HTMLResponse)
    def cancel_confirm(request: Request, job: str, viewer: Viewer = Depends(board.viewer)) -> Response:
        """The job page's Cancel asks first: this page's form is what cancels."""
        if not viewer.can_act:
            raise PageError(403, "this token is read-only: it can look, not act")
        row = visible(job, viewer)
        if row["status"] not in ACTIONS["cancel"]:
            return redirect(request, f"/jobs/{row['id']}")  # nothing left to cancel
        return board.render(request, "confirm_cancel.html", viewer, job=row)

    @app.post("/jobs/{job}/cancel")
    async def cancel(request: Request, job: str, viewer: Viewer = Depends(board.viewer)) -> Response:
        await form(request, viewer)
        row = visible(job, viewer)
        Acts(board, viewer).cancel([row["id"]])
        return redirect(request, f"/jobs/{row['id']}")

    @app.post("/jobs/{job}/retry")
    async def retry(request: Request, job: str, viewer: Viewer = Depends(board.viewer)) -> Response:
        await form(request, viewer)
        _allowed(viewer, "retry")
        row = visible(job, viewer)
        try:
            made = retry_as_new(board.leases, row["id"], tenant=viewer.tenant)
        except NotRetried as exc:
            raise PageError(409, str(exc)) from None
        return redirect(request, f"/jobs/{made}")

    @app.post("/jobs/{job}/delete")
    async def delete(request: Request, job: str, viewer: Viewer = Depends(board.viewer)) -> Response:
        await form(request, viewer)
        row = visible(job, viewer)
        if not Acts(board, viewer).delete([row["id"]]):
            raise PageError(409, f"job {row['id']} is {row['status']}: cancel it before deleting it")
        return redirect(request, "/jobs")

    @app.get("/bulk", response_class=HTMLResponse)
    def bulk_confirm(request: Request, viewer: Viewer = Depends(board.viewer)) -> Response:
        params = dict(request.query_params)
        action = _action(params.pop("action", None))
        _allowed(viewer, action)
        try:
            f = filters.parse(params, tenant=viewer.tenant, payloads=viewer.sees_payloads)
        except ValueError as exc:
            raise PageError(400, str(exc)) from None
        ids, more = _selection(board, f, action)
        return board.render(
            request,
            "confirm.html",
            viewer,
            action=action,
            count=len(ids),
            more=more,
            cap=BULK_CAP,
            scan=SCAN,
            fields=filters.form_values(f),
            filtered=filters.query_string(f),
        )

    @app.post("/bulk", response_class=HTMLResponse)
    async def bulk(request: Request, viewer: Viewer = Depends(board.viewer)) -> Response:
        fields = await form(request, viewer)
        action = _action(fields.pop("action", None))
        _allowed(viewer, action)
        fields.pop("csrf", None)
        try:
            f = filters.parse(fields, tenant=viewer.tenant, payloads=viewer.sees_payloads)
        except ValueError as exc:
            raise PageError(400, str(exc)) from None
        ids, more = _selection(board, f, action)
        acts = Acts(board, viewer)
        done = acts.cancel(ids) if action == "cancel" else len(acts.retry(ids)) if action == "retry" else acts.delete(ids)
        return board.render(
            request, "done.html", viewer, action=action, done=done, more=more, filtered=filters.query_string(f), cap=BULK_CAP
        )
