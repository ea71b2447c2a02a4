"""The HTTP API: jobs, runs, limits, health and metrics over the job table.

Started by ``celery -A proj lease serve [--host H] [--port P]`` (FastAPI on uvicorn;
needs the ``api`` extra), beside the dashboard (celery_lease.ops.dashboard). Around
every route (celery_lease.ops.guard): bodies over 16 KiB are answered 413 unread, and
every response carries the Content-Security-Policy and framing headers. The rule: a
token reaches no more than its grant (celery_lease.ops.tokens): another tenant's job is
404 at the same cost, writing routes refuse read-only tokens; errors are JSON
``{"error": code, "detail": text}`` and bad input changes and reads nothing, never a
5xx. docs/operations.md has the routes' whole contract and the security model;
docs/flow-control.md the limits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI, Path, Query, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import exc as sa_exc
from starlette.exceptions import HTTPException as StarletteHTTPException

from celery_lease.errors import DatabaseUnavailable, UnknownKind
from celery_lease.flow.limits import DEFAULT, LimitChange
from celery_lease.job import parse_job_id
from celery_lease.ops import listing, metrics
from celery_lease.ops.guard import Guard
from celery_lease.ops.keys import KeyLabels
from celery_lease.ops.retry import NotRetried, retry_as_new
from celery_lease.ops.tenants import add_tenant_routes
from celery_lease.ops.throttle import Gate, retry_after
from celery_lease.ops.tokens import (
    TOKENS_ENV,
    TOKENS_SETTING,
    Grant,
    Keyring,
    load_metrics_token,
    load_secret,
    load_tokens,
    matches,
    scrape_tokens,
)
from celery_lease.ops.wire import (
    CancelOut,
    ErrorOut,
    EventPageOut,
    HealthOut,
    JobOut,
    JobPageOut,
    KindLimitsOut,
    LimitsIn,
    LimitsOut,
    RetryOut,
)
from celery_lease.status import Event, Status

if TYPE_CHECKING:
    from celery_lease.extension import CeleryLease

log = logging.getLogger("celery_lease.api")

MAX_EVENTS_LIMIT = 1000
#: Said of every route in the schema: extra query parameters are refused, not ignored.
STRICT_QUERY = "Query parameters the route does not declare are refused (400)."


# --- errors -----------------------------------------------------------------------------


class ApiError(Exception):
    def __init__(self, status: int, error: str, detail: str | None = None, headers: dict | None = None) -> None:
        super().__init__(error)
        self.status, self.error, self.detail = status, error, detail
        self.headers = _UNAUTHORIZED if status == 401 else headers


def _error(status: int, error: str, detail: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": error, "detail": detail}, status_code=status, headers=headers)


_CONFLICT = {"model": ErrorOut, "description": "the job has not ended, or succeeded, or was already retried"}
_HTTP_CODES = {403: "forbidden", 404: "not_found", 405: "method_not_allowed"}
_UNAUTHORIZED = {"WWW-Authenticate": "Bearer"}

_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorOut, "description": "malformed id, status, limit, cursor or parameter"},
    401: {"model": ErrorOut, "description": "missing or unknown bearer token (/metrics: when tokens are configured)"},
    403: {"model": ErrorOut, "description": "a read-only token asked to change a job, or a tenant's token a kind's limits"},
    404: {"model": ErrorOut, "description": "no such job, run or kind visible to this token"},
    429: {"model": ErrorOut, "description": "this token's request rate (lease_api_rate) is spent: see Retry-After"},
    503: {"model": ErrorOut, "description": "the job database cannot be reached, or is not migrated"},
}


# Declared as UUIDs in the schema but parsed here, so a malformed id gets this
# module's 400 message rather than a validation dump.
JOB_ID = Path(description="the job's id, a UUID", json_schema_extra={"format": "uuid"})


#: The grant of the token a request carried (tenant, read-only).
Caller = Grant


def _parse_id(value: str, what: str) -> str:
    try:
        return parse_job_id(value)
    except ValueError:
        raise ApiError(400, "bad_request", f"malformed {what} id (expected a UUID)") from None


def _refuse_unknown_query(request: Request) -> None:
    """A misspelt filter (``?stauts=failed``) is an error, not a silently wider list;
    so is a repeated one (``?kind=a&kind=b`` would otherwise keep only one)."""
    route = request.scope.get("route")
    known = {p.alias for p in route.dependant.query_params} if route is not None else set()
    seen: set[str] = set()
    for name, _ in request.query_params.multi_items():
        if name not in known:
            raise ApiError(400, "bad_request", f"unknown query parameter {name[:40]!r}")
        if name in seen:
            raise ApiError(400, "bad_request", f"query parameter {name!r} given more than once")
        seen.add(name)


def create_app(leases: CeleryLease) -> FastAPI:
    """The ASGI app serving ``leases``; reads the tokens now (ConfigurationError if bad)."""
    tokens = load_tokens(leases.app.conf)
    metrics_token = load_metrics_token(leases.app.conf)
    secret = load_secret(leases.app.conf)
    labels = KeyLabels(secret)
    keyring = Keyring(tokens, secret)
    scrapes = metrics.CachedMetrics(leases, leases.settings.metrics_cache_seconds)
    gate = Gate(leases.settings.api_rate)
    if not tokens:
        log.warning(
            "celery-lease: no API tokens configured (%s or %s): every /api/v1 request gets 401",
            f"app.conf.{TOKENS_SETTING}",
            TOKENS_ENV,
        )
    bearer = HTTPBearer(auto_error=False, description="a token from lease_api_tokens")

    api = FastAPI(
        title="celery-lease",
        version="1",
        description="Durable Celery jobs: status, cancel, runs.",
        dependencies=[Depends(_refuse_unknown_query)],
        # Swagger UI and ReDoc load their scripts from a CDN: a script of a third party
        # on the dashboard's origin could read its CSRF tokens. The schema stays.
        docs_url=None,
        redoc_url=None,
    )
    api.add_middleware(Guard)

    @api.exception_handler(ApiError)
    async def on_api_error(request: Request, exc: ApiError):
        return _error(exc.status, exc.error, exc.detail, exc.headers)

    @api.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError):
        problems = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors())
        return _error(400, "bad_request", problems[:500])

    @api.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException):
        code = _HTTP_CODES.get(exc.status_code, f"http_{exc.status_code}")
        return _error(exc.status_code, code, None, getattr(exc, "headers", None))

    @api.exception_handler(DatabaseUnavailable)
    async def on_db_down(request: Request, exc: DatabaseUnavailable):
        # No detail: where the database is and why it failed is for the server's log.
        return _error(503, "database_unavailable", None)

    @api.exception_handler(sa_exc.ProgrammingError)
    async def on_schema_mismatch(request: Request, exc: sa_exc.ProgrammingError):
        # Our statements are fixed; one the database refuses means its tables are
        # missing or older than this version of celery-lease.
        log.error(
            "celery-lease: the job database lacks celery-lease's tables or columns (run: celery -A <app> lease migrate): %s",
            exc.orig,
        )
        return _error(503, "schema_not_migrated", None)

    def checked(request: Request, credentials: HTTPAuthorizationCredentials | None, accept: Callable[[str], Any]) -> Any:
        """What ``accept`` makes of the offered bearer token; 401 when it makes None.
        A wrong token spends the address's and everyone's failure budget, and once
        either is spent no token is even compared (429; see throttle.Gate)."""
        if credentials is None:  # no guess: costs nothing
            raise ApiError(401, "unauthorized")
        address = request.client.host if request.client else ""
        wait = gate.locked(address)
        if wait:
            raise ApiError(429, "rate_limited", None, {"Retry-After": retry_after(wait)})
        found = accept(credentials.credentials)
        gate.attempted(address, found is not None)  # a right one lets it past a global lockout
        if found is None:
            raise ApiError(401, "unauthorized")
        return found

    def caller(request: Request, credentials: HTTPAuthorizationCredentials | None = Security(bearer)) -> Caller:
        holder = checked(request, credentials, keyring.find)
        # The token's own rate, one budget with its dashboard sessions.
        wait = gate.admit(holder.ident)
        if wait:
            raise ApiError(429, "rate_limited", None, {"Retry-After": retry_after(wait)})
        return holder.grant

    def visible_job(job_id: str, who: Caller) -> dict[str, Any]:
        view = leases.store.get_view(_parse_id(job_id, "job"), tenant=who.tenant)
        if view is None:
            raise ApiError(404, "not_found")
        return view

    @api.get("/api/v1/jobs/{job_id}", response_model=JobOut, responses=_ERRORS, description=STRICT_QUERY)
    def get_job(job_id: str = JOB_ID, who: Caller = Security(caller)):
        job = visible_job(job_id, who)
        return {**listing.api_view(job), "attempts": listing.attempts_view(job["attempts"], show_worker=who.tenant is None)}

    @api.post("/api/v1/jobs/{job_id}/cancel", response_model=CancelOut, responses=_ERRORS)
    def cancel_job(job_id: str = JOB_ID, who: Caller = Security(caller)):
        """Cancel a pending or running job; ``cancelled`` is false when it had already
        finished (its status is unchanged). Query parameters the route does not declare
        are refused (400)."""
        job = visible_job(job_id, who)
        if who.read_only:
            raise ApiError(403, "forbidden", "this token is read-only")
        cancelled = leases.cancel(job["id"])
        now = leases.store.get_view(job["id"]) or job
        return {"id": job["id"], "cancelled": cancelled, "status": now["status"]}

    @api.post("/api/v1/jobs/{job_id}/retry", response_model=RetryOut, responses={**_ERRORS, 409: _CONFLICT})
    def retry_job(job_id: str = JOB_ID, who: Caller = Security(caller)):
        """Submit a failed, expired or cancelled job again as a new job (the dashboard's
        retry), whose fencing tokens start above every token of the original; once per job
        (then 409). Tokens bound to no tenant and not read-only only; undeclared query parameters: 400."""
        if who.read_only or who.tenant is not None:
            raise ApiError(403, "forbidden", "retry needs a token bound to no tenant and not read-only")
        job = visible_job(job_id, who)
        try:
            return {"job_id": retry_as_new(leases, job["id"])}
        except NotRetried as exc:
            raise ApiError(409, "conflict", str(exc)) from None

    @api.get("/api/v1/jobs", response_model=JobPageOut, responses=_ERRORS, description=STRICT_QUERY)
    def list_jobs(
        who: Caller = Security(caller),
        status: str | None = Query(None, json_schema_extra={"enum": [s.value for s in Status]}),
        kind: str | None = Query(None, max_length=listing.MAX_KIND_CHARS, json_schema_extra={"pattern": "^[^\\x00]*$"}),
        limit: int = Query(listing.DEFAULT_LIMIT, ge=1, le=listing.MAX_LIMIT),
        cursor: str | None = Query(None, max_length=listing.MAX_CURSOR_CHARS, description="next_cursor of the previous page"),
        queue: str | None = Query(None, max_length=listing.MAX_QUEUE_CHARS, json_schema_extra={"pattern": "^[^\\x00]*$"}),
    ):
        try:
            query = listing.Query.parse(status=status, kind=kind, limit=limit, cursor=cursor, queue=queue)
        except ValueError as exc:
            raise ApiError(400, "bad_request", str(exc)) from None
        page = listing.list_view_page(leases, query, tenant=who.tenant)
        return {"jobs": page.rows, "next_cursor": page.next_cursor}

    @api.get("/api/v1/runs/{run_id}/events", response_model=EventPageOut, responses=_ERRORS, description=STRICT_QUERY)
    def run_events(
        run_id: str = Path(description="the run's id, a UUID", json_schema_extra={"format": "uuid"}),
        who: Caller = Security(caller),
        # Event ids are BIGINT; SQLite's driver cannot even bind a larger integer.
        after: int = Query(0, ge=0, le=2**63 - 1, description="next_after of the previous page"),
        limit: int = Query(100, ge=1, le=MAX_EVENTS_LIMIT),
    ):
        run_id = _parse_id(run_id, "run")
        # A run is visible when it holds a job the caller may see.
        if not leases.store.run_visible(run_id, tenant=who.tenant):
            raise ApiError(404, "not_found")
        if who.tenant is None:
            rows = leases.store.run_events(run_id, after_id=after, limit=limit + 1)
        else:
            rows = [
                # Numbered among the tenant's own events; the claiming worker withheld.
                {**r, "id": r["seq"], "detail": None if r["event"] == Event.CLAIMED.value else r["detail"]}
                for r in leases.store.tenant_run_events(run_id, who.tenant, after_seq=after, limit=limit + 1)
            ]
        more = len(rows) > limit
        rows = rows[:limit]
        events = [{**r, "run_id": str(r["run_id"]), "job_id": str(r["job_id"])} for r in rows]
        return {"run_id": run_id, "events": events, "next_after": rows[-1]["id"] if more else None}

    @api.get("/api/v1/limits", response_model=LimitsOut, responses=_ERRORS, description=STRICT_QUERY)
    def limits(who: Caller = Security(caller)):
        """Flow control per kind and concurrency key. A tenant's token counts only
        that tenant's jobs; a token that may not read payloads sees a label for each
        key (keys are payload text: celery_lease.ops.keys)."""
        return {"kinds": labels.rows(leases.limits(tenant=who.tenant), "key", payloads=who.sees_payloads)}

    #: The kind in a limits route: as wide as the kind column, no NUL (checked by kind_of).
    KIND = Path(description="the job kind", max_length=listing.MAX_KIND_CHARS, json_schema_extra={"pattern": "^[^\\x00]*$"})

    def admin(kind: str, who: Caller) -> None:
        """A kind's limits bind every tenant's jobs: only a token bound to no tenant and
        not read-only changes them (checked before the body is looked at)."""
        if who.tenant is not None:
            raise ApiError(403, "forbidden", "a tenant's token cannot change limits that bind every tenant's jobs")
        if who.read_only:
            raise ApiError(403, "forbidden", "this token is read-only")
        if "\x00" in kind:
            raise ApiError(400, "bad_request", "malformed kind")

    def change_limits(kind: str, change: LimitChange) -> dict[str, Any]:
        try:
            leases.import_task_modules()  # the kinds the workers declare, not only those imported here
            return {"kind": kind, **leases.flow.set_limits(kind, change)}
        except UnknownKind as exc:
            raise ApiError(404, "not_found", str(exc)) from None

    @api.put("/api/v1/kinds/{kind}/limits", response_model=KindLimitsOut, responses=_ERRORS, description=STRICT_QUERY)
    def set_kind_limits(body: LimitsIn, kind: str = KIND, who: Caller = Security(caller)):
        """Set or clear a kind's concurrency and rate limit for every worker (see the
        module's docstring: null is no limit, "default" what the code declares)."""
        admin(kind, who)
        given = body.model_fields_set
        try:
            change = LimitChange.parse(
                concurrency=body.concurrency,
                rate=body.rate_limit,
                given=("concurrency" in given, "rate_limit" in given),
            )
        except ValueError as exc:
            raise ApiError(400, "bad_request", str(exc)) from None
        return change_limits(kind, change)

    @api.delete("/api/v1/kinds/{kind}/limits", response_model=KindLimitsOut, responses=_ERRORS, description=STRICT_QUERY)
    def clear_kind_limits(kind: str = KIND, who: Caller = Security(caller)):
        """A kind's concurrency and rate limit back to what the code declares."""
        admin(kind, who)
        return change_limits(kind, LimitChange(concurrency=DEFAULT, rate=DEFAULT))

    add_tenant_routes(api, leases, caller, ApiError, _ERRORS)  # GET /api/v1/tenants, PUT .../{tenant}/weight

    @api.get(
        "/healthz", response_model=HealthOut, responses={400: _ERRORS[400], 503: {"model": HealthOut}}, description=STRICT_QUERY
    )
    def healthz():
        try:
            leases.store.ping()
        except DatabaseUnavailable:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok"}

    scrape_with = scrape_tokens(tokens, metrics_token)

    def scraper(request: Request, credentials: HTTPAuthorizationCredentials | None = Security(bearer)) -> None:
        # Every token compared (a list, not any()'s short cut): the time tells nothing.
        checked(request, credentials, lambda offered: True if any([matches(offered, t) for t in scrape_with or ()]) else None)

    guarded = scrape_with is not None  # the schema says /metrics needs a token exactly when it does
    metrics_responses: dict[int | str, dict[str, Any]] = {c: _ERRORS[c] for c in ((400, 401, 503) if guarded else (400, 503))}

    @api.get(
        "/metrics",
        response_class=Response,
        responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text"}, **metrics_responses},
        dependencies=[Security(scraper)] if guarded else [],
        description=STRICT_QUERY,
    )
    def prometheus():
        return Response(scrapes.render(), media_type=metrics.CONTENT_TYPE)

    _mount_dashboard(api, leases, keyring, secret, gate)
    return api


def _mount_dashboard(api: FastAPI, leases: CeleryLease, keyring: Keyring, secret: bytes, gate: Gate) -> None:
    """The dashboard at /dashboard (celery_lease.ops.dashboard), when Jinja2 is installed."""
    try:
        from celery_lease.ops.dashboard import create_dashboard
    except ImportError:  # an api extra installed before the dashboard needed jinja2
        log.warning("celery-lease: no dashboard at /dashboard: it needs jinja2 (pip install 'celery-lease[api]')")
        return
    api.mount("/dashboard", create_dashboard(leases, keyring, secret, gate))
