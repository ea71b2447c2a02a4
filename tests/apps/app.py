"""The Celery app the tests run in real worker processes.

Configured from the environment so each test can point workers at its own database
and broker: CL_TEST_DB, CL_TEST_BROKER, and CL_TEST_CONF (JSON of extra app.conf).
Handlers are steered by their payload, so one app serves every scenario.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import sqlalchemy as sa
from celery import Celery
from pydantic import BaseModel

from celery_lease import CeleryLease, Failure, JobContext

app = Celery("tests", broker=os.environ.get("CL_TEST_BROKER", "memory://"))
app.conf.update(
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=False,
    task_default_queue="celery",
    broker_transport_options={"visibility_timeout": 3600},
)
app.conf.update(json.loads(os.environ.get("CL_TEST_CONF", "{}")))
leases = CeleryLease(app, os.environ.get("CL_TEST_DB"))

if os.environ.get("CL_TEST_COMPLETION_LINGER"):
    # Hold plain successes in the completer's batch this long (tests of its flush).
    from celery_lease.worker.completion import BackgroundCompleter

    BackgroundCompleter.LINGER = float(os.environ["CL_TEST_COMPLETION_LINGER"])

if os.environ.get("CL_TEST_REVOKE_GIVE_UP"):
    # Give a revoke up sooner while the database is away (tests of what follows).
    from celery_lease.worker.revoke import Revoker

    Revoker.GIVE_UP = float(os.environ["CL_TEST_REVOKE_GIVE_UP"])

# The handler's own rows: written through ctx.effect, in the success transaction.
test_metadata = sa.MetaData()
effects = sa.Table(
    "test_effects",
    test_metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("job_id", sa.String(36), nullable=False),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("note", sa.String(100)),
)


def _marker(payload: dict, name: str) -> None:
    """Touch a file so the test can see how far a handler got, and in which attempt."""
    directory = payload.get("marker_dir")
    if directory:
        with open(os.path.join(directory, name), "a") as fh:
            fh.write(f"{os.getpid()}\n")


@leases.job(kind="echo", max_attempts=3, lease_seconds=30)
def echo(ctx: JobContext, payload: dict) -> dict:
    _marker(payload, f"echo-{ctx.job_id}")
    return {"echo": payload.get("value"), "attempt": ctx.attempt}


@leases.job(
    kind="steps",
    max_attempts=3,
    lease_seconds=int(os.environ.get("CL_TEST_LEASE", "6")),
    retry_backoff=0.2,
    retry_backoff_max=0.5,
)
def steps(ctx: JobContext, payload: dict) -> dict:
    """Counts to payload["steps"], sleeping payload["sleep"] each step, checkpointing
    and publishing progress; resumes from its checkpoint."""
    start = (ctx.checkpoint or {}).get("i", 0)
    _marker(payload, f"start-{ctx.attempt}-{start}")
    for i in range(start, payload["steps"]):
        ctx.raise_if_cancelled()
        time.sleep(payload.get("sleep", 0.1))
        ctx.publish({"done": i + 1, "of": payload["steps"]})
        ctx.save_checkpoint({"i": i + 1})
    if payload.get("effect"):
        ctx.effect(lambda conn: conn.execute(effects.insert().values(job_id=ctx.job_id, attempt=ctx.attempt, note="steps")))
    return {"counted": payload["steps"], "resumed_from": start}


@leases.job(kind="flaky", max_attempts=3, lease_seconds=30, retry_backoff=0.1, retry_backoff_max=0.2)
def flaky(ctx: JobContext, payload: dict) -> dict:
    """Raises a dependency-style error carrying a secret (from the worker's environment,
    as a DSN password would be) until attempt payload["ok_at"]."""
    if payload.get("failure"):
        raise Failure(payload["failure"])
    if ctx.attempt < payload.get("ok_at", 10**6):
        error = {"timeout": TimeoutError, "value": ValueError}.get(payload.get("raise"), ConnectionError)
        raise error(f"could not connect: password={os.environ.get('CL_TEST_SECRET', 'hunter2')}")
    return {"ok_at": ctx.attempt}


@leases.job(kind="sleepy", max_attempts=2, lease_seconds=int(os.environ.get("CL_TEST_LEASE", "6")))
def sleepy(ctx: JobContext, payload: dict) -> dict:
    """Sleeps without cooperating (no raise_if_cancelled), then writes an effect."""
    _marker(payload, f"sleepy-{ctx.job_id}-{ctx.attempt}")
    time.sleep(payload.get("sleep", 1.0))
    ctx.effect(lambda conn: conn.execute(effects.insert().values(job_id=ctx.job_id, attempt=ctx.attempt, note="sleepy")))
    return {"slept": payload.get("sleep", 1.0)}


@dataclass
class Point:
    x: int
    y: int


class Order(BaseModel):
    sku: str
    quantity: int


@leases.job(kind="typed_dc", max_attempts=1)
def typed_dc(ctx: JobContext, payload: Point) -> Point:
    assert isinstance(payload, Point)
    return Point(x=payload.x * 2, y=payload.y * 2)


@leases.job(kind="typed_pd", max_attempts=1)
def typed_pd(ctx: JobContext, payload: Order) -> Order:
    assert isinstance(payload, Order)
    return Order(sku=payload.sku.upper(), quantity=payload.quantity + 1)


@leases.job(kind="parent", max_attempts=2)
def parent(ctx: JobContext, payload: dict) -> dict:
    placed = {"run_id": payload["child_run"]} if "child_run" in payload else {}
    for value in payload.get("children", []):
        ctx.submit("echo", {"value": value}, **placed)
    if payload.get("fail_after_submit"):
        raise Failure("parent failed after staging children")
    return {"children": len(payload.get("children", []))}
