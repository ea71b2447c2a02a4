"""The dashboard at ``/dashboard`` of ``celery -A proj lease serve`` (the ``api`` extra).

Server-rendered pages (Jinja2 templates in ``templates/``), one small script for the
live figures (``static/live.js``, polling ``live.json``); nothing is loaded from the
network. Pages: ``login``, ``jobs``, ``jobs/{id}``, ``kinds``, ``live``, ``workers``,
``reconcile`` (docs/operations.md, "Dashboard"). The rule: a token sees and does here
what the API lets it. Without a session only the login form and static files are served
(:mod:`.access`); a read-only token gets no action, a tenant token only its tenant's
jobs and no fleet-wide figure, payloads only a token that may read them; each request
spends the token's API request rate (throttle.Gate) and passes celery_lease.ops.guard.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from sqlalchemy import exc as sa_exc
from starlette.exceptions import HTTPException as StarletteHTTPException

from celery_lease.errors import DatabaseUnavailable
from celery_lease.ops.dashboard import actions, fleet, pages
from celery_lease.ops.dashboard.access import COOKIE
from celery_lease.ops.dashboard.web import HERE, Board, PageError, SignIn, redirect
from celery_lease.ops.keys import KeyLabels
from celery_lease.ops.throttle import Gate
from celery_lease.ops.tokens import Keyring

if TYPE_CHECKING:
    from celery_lease.extension import CeleryLease


def create_dashboard(leases: CeleryLease, keyring: Keyring, secret: bytes, gate: Gate) -> FastAPI:
    """The dashboard's ASGI app, to mount at ``/dashboard``: the API's tokens, secret
    and rates (celery_lease.ops.api.create_app)."""
    board = Board.of(leases, keyring, secret, gate)
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")

    def error_page(request: Request, status: int, message: str, headers: dict[str, str] | None = None) -> Response:
        if request.url.path.endswith(".json"):
            return JSONResponse({"error": message}, status_code=status, headers=headers)
        viewer = board.sessions.viewer(request.cookies.get(COOKIE))
        return board.render(request, "error.html", viewer, status=status, message=message, headers=headers)

    @app.exception_handler(SignIn)
    async def on_sign_in(request: Request, exc: SignIn) -> Response:
        if request.method == "GET" and not request.url.path.endswith(".json"):
            return redirect(request, "/login")
        return error_page(request, 401, "sign in first")

    @app.exception_handler(PageError)
    async def on_page_error(request: Request, exc: PageError) -> Response:
        return error_page(request, exc.status, exc.message, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException) -> Response:
        return error_page(request, exc.status_code, "no such page" if exc.status_code == 404 else str(exc.detail))

    @app.exception_handler(DatabaseUnavailable)
    async def on_db_down(request: Request, exc: DatabaseUnavailable) -> Response:
        return error_page(request, 503, "the job database does not answer")

    @app.exception_handler(sa_exc.ProgrammingError)
    async def on_schema_mismatch(request: Request, exc: sa_exc.ProgrammingError) -> Response:
        # Our statements are fixed: one the database refuses means it is not migrated
        # (the API's handler logs the driver's text; the page never shows it).
        return error_page(request, 503, "the job database lacks celery-lease's tables (run: celery -A <app> lease migrate)")

    labels = KeyLabels(secret)
    pages.register(app, board, labels)
    actions.register(app, board)
    fleet.register(app, board, labels)
    return app
