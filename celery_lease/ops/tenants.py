"""The API's tenant routes: fair share's weights (docs/flow-control.md#fair-share).

    GET /api/v1/tenants                  each tenant's weight, pending and running fair
                                         jobs and share (a tenant's token: its own only)
    PUT /api/v1/tenants/{tenant}/weight  {"weight": N | "default"}; tokens bound to no
                                         tenant and not read-only (else 403)

Mounted by :func:`celery_lease.ops.api.create_app` with its caller check and error type.
A bad weight (0, negative, not a number) is 400 saying what is wrong, and changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Literal

from fastapi import FastAPI, Path, Security
from pydantic import BaseModel, ConfigDict, Field

from celery_lease.flow.fair import MAX_TENANT_CHARS, MAX_WEIGHT, FairShare

if TYPE_CHECKING:
    from celery_lease.extension import CeleryLease
    from celery_lease.ops.tokens import Grant


class WeightIn(BaseModel):
    """PUT /api/v1/tenants/{tenant}/weight: a positive number, or "default" (1)."""

    model_config = ConfigDict(extra="forbid")

    # A JSON number (strict: not a string, not true), above 0, or "default".
    weight: Annotated[float, Field(gt=0, le=MAX_WEIGHT, strict=True)] | Literal["default"]


class TenantOut(BaseModel):
    """A tenant's weight, its fair kinds' pending and running jobs, and the share of the
    fleet its weight entitles it to among tenants with such jobs (null: it has none).
    ``tenant`` null: the jobs submitted without a tenant."""

    tenant: str | None
    weight: float
    pending: int
    running: int
    share: float | None = None


class TenantsOut(BaseModel):
    tenants: list[TenantOut]


def add_tenant_routes(
    api: FastAPI, leases: CeleryLease, caller: Callable[..., Grant], error: Callable[..., Exception], responses: dict
) -> None:
    """The routes above, on ``api``; ``caller``: the bearer check (a Grant), ``error``:
    ApiError(status, code, detail)."""
    fair = FairShare(leases.store)
    tenant_path = Path(
        description="the tenant", min_length=1, max_length=MAX_TENANT_CHARS, json_schema_extra={"pattern": "^[^\\x00]*$"}
    )

    @api.get("/api/v1/tenants", response_model=TenantsOut, responses=responses)
    def list_tenants(who: Grant = Security(caller)):
        """Fair share per tenant. A tenant's token sees its own row only."""
        rows = fair.tenants()
        if who.tenant is not None:
            rows = [r for r in rows if r["tenant"] == who.tenant]
        return {"tenants": rows}

    @api.put("/api/v1/tenants/{tenant}/weight", response_model=TenantOut, responses=responses)
    def set_tenant_weight(body: WeightIn, tenant: str = tenant_path, who: Grant = Security(caller)):
        """Set a tenant's weight in every fair kind, for every worker (stored; the next
        claims obey it); "default" makes it 1 again."""
        if who.tenant is not None:
            raise error(403, "forbidden", "a tenant's token cannot change weights that share the fleet among tenants")
        if who.read_only:
            raise error(403, "forbidden", "this token is read-only")
        try:
            return fair.set_weight(tenant, body.weight)
        except ValueError as exc:
            raise error(400, "bad_request", str(exc)) from None
