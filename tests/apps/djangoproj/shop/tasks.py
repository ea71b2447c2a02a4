"""Found by ``app.autodiscover_tasks()``: a reusable app's leased jobs, declared with
``shared_job`` (no import of the project's CeleryLease), and ``django.tasks`` tasks."""

from __future__ import annotations

import sys
import time

import sqlalchemy as sa

from celery_lease import JobContext, shared_job
from tests.apps.djangoproj.shop.models import Order

if sys.version_info >= (3, 12):
    from django.tasks import task
else:
    from django_tasks import task


@shared_job(kind="shop_fulfil", max_attempts=2, lease_seconds=4)
def fulfil(ctx: JobContext, payload: dict) -> dict:
    """Marks the order fulfilled, through the ORM, in the worker."""
    updated = Order.objects.filter(reference=payload["reference"]).update(status="fulfilled")
    return {"updated": updated}


@shared_job(kind="shop_pay", max_attempts=2)
def pay(ctx: JobContext, payload: dict) -> dict:
    """docs/converting.md's ctx.effect example: the order is marked paid in the transaction
    that records the job's success, through the job database's connection."""
    charge = f"charge-{ctx.job_id}"  # an external call would take ctx.job_id as its idempotency key
    orders = Order._meta.db_table
    ctx.effect(
        lambda conn: conn.execute(
            sa.text(f"UPDATE {orders} SET status = 'paid' WHERE reference = :reference"),
            {"reference": payload["reference"]},
        )
    )
    return {"charge": charge}


@shared_job(kind="shop_slow", lease_seconds=4, concurrency=2)
def slow(ctx: JobContext, payload: dict) -> dict:
    deadline = time.monotonic() + payload.get("sleep", 0.0)
    while time.monotonic() < deadline:
        ctx.raise_if_cancelled()
        time.sleep(0.05)
    return {}


@shared_job(kind="shop_nightly", max_attempts=1)
def nightly(ctx: JobContext, payload: dict) -> dict:
    """Scheduled by the project's celery.py (CL_TEST_NIGHTLY)."""
    return payload


@task()
def add(a: int, b: int) -> int:
    return a + b


@task(takes_context=True)
def attempt_of(context, fail_first: bool) -> dict:
    if fail_first and context.attempt < 2:
        raise RuntimeError("first attempt fails (secret=hunter2)")
    return {"attempt": context.attempt}


@task()
def always_fails() -> None:
    raise RuntimeError("boom (secret=hunter2)")
