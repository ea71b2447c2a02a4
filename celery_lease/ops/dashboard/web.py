"""What every dashboard route shares: templates, who is signed in, forms and errors.

Pages are rendered by Jinja2 with autoescaping on: job data (payloads, results,
errors, kinds) is whatever a submitter or handler wrote and is only ever shown as
text. Every response forbids framing and inline scripts (Content-Security-Policy, sent by
celery_lease.ops.guard with every response of the server), so neither a stored string
nor another site can drive the page.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlsplit

import jinja2
from fastapi import Request
from fastapi.responses import HTMLResponse, RedirectResponse

from celery_lease.db.dashboard_store import DashboardStore
from celery_lease.job import parse_job_id
from celery_lease.ops.dashboard.access import COOKIE, Sessions, Viewer, csrf_ok
from celery_lease.ops.throttle import Gate, retry_after
from celery_lease.ops.tokens import Keyring

if TYPE_CHECKING:
    from celery_lease.extension import CeleryLease

HERE = Path(__file__).resolve().parent


class PageError(Exception):
    """Answered with the error page (or JSON for /live.json): 400, 403, 404, 429, 503."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers


class SignIn(Exception):
    """No valid session: a page redirects to the login form, anything else is 401."""


def _when(value: Any) -> str:
    if not isinstance(value, datetime):
        return ""
    return value.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _age(seconds: float | None) -> str:
    if seconds is None:
        return ""
    seconds = float(seconds)
    sign = "-" if seconds < 0 else ""
    seconds = abs(seconds)
    if seconds < 120:
        return f"{sign}{seconds:.1f} s"
    if seconds < 7200:
        return f"{sign}{seconds / 60:.0f} min"
    return f"{sign}{seconds / 3600:.1f} h"


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["when"] = _when
    env.filters["age"] = _age
    env.filters["num"] = lambda n: f"{n:,}" if isinstance(n, int) else n
    env.filters["pretty"] = lambda v: json.dumps(v, indent=2, default=str)
    return env


@dataclass
class Board:
    """The dashboard's dependencies, handed to each group of routes."""

    leases: CeleryLease
    store: DashboardStore
    sessions: Sessions
    gate: Gate
    env: jinja2.Environment

    @classmethod
    def of(cls, leases: CeleryLease, keyring: Keyring, secret: bytes, gate: Gate) -> Board:
        store = DashboardStore(leases.store)
        return cls(leases, store, Sessions(keyring, store, secret), gate, _environment())

    def viewer(self, request: Request) -> Viewer:
        """The signed-in viewer, whose token's request rate this request spends (every
        route's dependency: the same budget as the token's API requests); raises
        SignIn without a session, PageError 429 over the rate."""
        viewer = self.sessions.viewer(request.cookies.get(COOKIE))
        if viewer is None:
            raise SignIn()
        wait = self.gate.admit(viewer.holder.ident)
        if wait:
            raise PageError(429, "too many requests: wait a moment", {"Retry-After": retry_after(wait)})
        return viewer

    def render(
        self,
        request: Request,
        template: str,
        viewer: Viewer | None,
        status: int = 200,
        headers: dict[str, str] | None = None,
        **context: Any,
    ) -> HTMLResponse:
        html = self.env.get_template(template).render(base=base(request), viewer=viewer, path=request.url.path, **context)
        return HTMLResponse(html, status_code=status, headers=headers)


def base(request: Request) -> str:
    """The dashboard's own prefix (``/dashboard``): links are built on it."""
    return request.scope.get("root_path", "").rstrip("/")


def redirect(request: Request, to: str) -> RedirectResponse:
    """303 to a dashboard path: the browser follows with a GET (post/redirect/get)."""
    return RedirectResponse(base(request) + to, status_code=303)


_DEFAULT_PORTS = {"http": "80", "https": "443"}


def _origin(scheme: str, host: str) -> str:
    """``scheme://host[:port]`` lowercased, without the scheme's default port."""
    scheme, host = scheme.strip().lower(), host.strip().lower()
    default = _DEFAULT_PORTS.get(scheme)
    if default and host.endswith(f":{default}"):
        host = host[: -len(default) - 1]
    return f"{scheme}://{host}"


def _first(request: Request, header: str) -> str | None:
    value = request.headers.get(header)
    return (value.split(",")[0].strip() or None) if value else None


def foreign_origin(request: Request) -> bool:
    """True when the browser says this POST was sent by a page of another origin: its
    Origin (``null`` included), else Sec-Fetch-Site cross-site or same-site, else its
    Referer names another origin. Without any of them (curl, scripts) it is no
    browser's cross-site form: it passes.

    This server's origin is the request's scheme and Host, or the scheme and host a
    proxy forwards (X-Forwarded-Proto / X-Forwarded-Host, whoever sent them): a page of
    another site cannot make a browser send either header, nor Host, so believing them
    lets no cross-site form through, and the check holds behind a TLS proxy that
    rewrites both, with or without ``serve --proxy-headers``."""
    offered = request.headers.get("origin")
    if offered is None:
        if request.headers.get("sec-fetch-site", "").lower() in ("cross-site", "same-site"):
            return True
        referer = request.headers.get("referer")
        if not referer:
            return False
        parts = urlsplit(referer)
        offered = f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}"
    schemes = {request.url.scheme, _first(request, "x-forwarded-proto")}
    hosts = {request.headers.get("host"), _first(request, "x-forwarded-host")}
    own = {_origin(scheme, host) for scheme in schemes for host in hosts if scheme and host}
    return _origin(*offered.split("://", 1)) not in own if "://" in offered else True


async def form(request: Request, viewer: Viewer | None, *, action: bool = True) -> dict[str, str]:
    """The POSTed url-encoded form, sent from this server's own pages (403 otherwise:
    foreign_origin). An action also needs a viewer who may act, and the session's CSRF
    token in the form (403 otherwise, before anything is read)."""
    if foreign_origin(request):
        raise PageError(403, "this form was sent from another site's page: sign in and act from the dashboard itself")
    if request.headers.get("content-type", "").split(";")[0].strip() != "application/x-www-form-urlencoded":
        raise PageError(400, "expected a form (application/x-www-form-urlencoded)")
    body = await request.body()  # bounded by celery_lease.ops.guard before it was read
    try:
        fields = dict(parse_qsl(body.decode(), keep_blank_values=True))
    except (UnicodeDecodeError, ValueError):
        raise PageError(400, "malformed form") from None
    if action:
        assert viewer is not None
        if not csrf_ok(viewer, fields.get("csrf")):
            raise PageError(403, "the form's CSRF token is missing or stale: reload the page and try again")
        if not viewer.can_act:
            raise PageError(403, "this token is read-only: it can look, not act")
    return fields


def job_id(value: str) -> str:
    try:
        return parse_job_id(value)
    except ValueError:
        raise PageError(404, "no such job") from None
