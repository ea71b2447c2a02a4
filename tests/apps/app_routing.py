"""The tests' app plus kinds Celery routes away from the default queue
(tests/e2e/test_routing.py): a task_routes glob, a router function that reads the
payload, and a decorator's queue=.

Run by workers as ``celery -A tests.apps.app_routing worker -Q ...``.
"""

from __future__ import annotations

from typing import Any

from celery_lease import JobContext
from tests.apps.app import app, echo, leases  # noqa: F401  (app: celery -A finds it here)


def by_tenant(name: str, args: tuple, kwargs: dict, options: dict, task: Any = None, **_: Any) -> dict | None:
    """A router function: a tenant's jobs go to that tenant's queue. It needs the payload,
    which only a submit has (a wakeup carries none)."""
    if name == "tests.apps.app_routing.tenant_echo" and args and isinstance(args[0], dict):
        return {"queue": f"tenant-{args[0]['tenant']}"}
    return None


app.conf.task_routes = [by_tenant, {"tests.apps.app_routing.routed_*": {"queue": "routed"}}]


@leases.job(kind="routed_echo")
def routed_echo(ctx: JobContext, payload: dict) -> dict:
    return {"echo": payload.get("value"), "attempt": ctx.attempt}


@leases.job(kind="tenant_echo", retry_backoff=0.2, retry_backoff_max=0.5)
def tenant_echo(ctx: JobContext, payload: dict) -> dict:
    if payload.get("fail_first") and ctx.attempt == 1:
        raise RuntimeError("transient")
    return {"tenant": payload["tenant"]}


# The decorator's queue= wins over the glob above, as a Celery task's own queue does.
@leases.job(kind="routed_pinned", queue="pinned")
def routed_pinned(ctx: JobContext, payload: dict) -> dict:
    return {"pinned": True}
