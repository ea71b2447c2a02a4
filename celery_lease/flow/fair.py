"""Tenants' weights for fair kinds (``@leases.job(fair=True)``): checked where they enter
(the CLI, the API), stored, and read with each tenant's jobs and share. How claims obey
them: :mod:`celery_lease.db.statements.fair`."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from celery_lease.db.statements import fair as fs
from celery_lease.errors import InvalidPayload
from celery_lease.payload import storable_text

if TYPE_CHECKING:
    from celery_lease.db.store import Store

#: As wide as celery_lease_tenant_weights.tenant (and the jobs' tenant column).
MAX_TENANT_CHARS = 200
#: The largest weight: a step of 1 / weight stays far from a double's precision at
#: any key a kind reaches.
MAX_WEIGHT = 1_000_000


def parse_weight(value: Any) -> float | None:
    """A weight as given (a number, its text, or "default" / None: back to 1), checked:
    ValueError saying what is wrong, quoting nothing but the value's kind."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "default"):
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"weight must be a positive number or 'default', not a {type(value).__name__}")
    try:
        weight = float(value)
    except ValueError:
        raise ValueError("weight must be a positive number or 'default'") from None
    if not math.isfinite(weight) or weight <= 0:
        raise ValueError("weight must be a positive number (above 0) or 'default'")
    if weight > MAX_WEIGHT:
        raise ValueError(f"weight must be at most {MAX_WEIGHT}")
    return weight


def check_tenant(tenant: Any) -> str:
    """A tenant as given at the boundary: storable text, not empty (ValueError)."""
    try:
        tenant = storable_text(tenant, "tenant", MAX_TENANT_CHARS)
    except InvalidPayload as exc:
        raise ValueError(str(exc)) from None
    if not tenant:
        raise ValueError("tenant must not be empty")
    return tenant


class FairShare:
    """Weights and what each tenant holds, over one Store."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def set_weight(self, tenant: Any, weight: Any) -> dict[str, Any]:
        """``tenant`` weighs ``weight`` in every fair kind from now on (stored, fleet-wide:
        claims read it from the keys), "default" / None: 1 again. Its pending fair jobs
        are re-spaced in the same transaction, so the next claims obey it. ValueError
        for bad input, before anything is written. Returns the tenant's row of
        :meth:`tenants`."""
        tenant, value = check_tenant(tenant), parse_weight(weight)
        store = self._store

        def work(conn) -> None:
            if value is None:
                conn.execute(fs.clear_weight(), {"tenant": tenant})
            else:
                conn.execute(fs.set_weight(store.dialect), {"tenant": tenant, "weight": value})
            conn.execute(fs.respace(), {"of_tenant": tenant})

        store.transaction(store.durable, work)
        row = next((r for r in self.tenants() if r["tenant"] == tenant), None)
        return row or {"tenant": tenant, "weight": value or fs.DEFAULT_WEIGHT, "pending": 0, "running": 0, "share": None}

    def tenants(self) -> list[dict[str, Any]]:
        """Each tenant with fair jobs pending or running, or a stored weight: its
        ``weight``, ``pending`` and ``running`` fair jobs, and ``share``: the part of
        the fleet its weight entitles it to among the tenants with fair jobs waiting or
        running (None when it has none)."""
        store = self._store
        rows = [dict(r) for r in store.transaction(store.durable, lambda c: c.execute(fs.tenants()).mappings().all())]
        active = sum(r["weight"] for r in rows if r["pending"] or r["running"])
        for row in rows:
            row["share"] = round(row["weight"] / active, 4) if active and (row["pending"] or row["running"]) else None
        return rows
