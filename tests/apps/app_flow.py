"""The tests' app plus the flow-control kinds (tests/e2e/test_flow.py).

Run by workers as ``celery -A tests.apps.app_flow worker``. Every body records its own
start and end in ``test_flow_spans`` with the database clock, so a test measures how
many bodies really ran at once, whoever ran them.
"""

from __future__ import annotations

import os
import time

import sqlalchemy as sa

from celery_lease import JobContext
from tests.apps.app import _marker, app, effects, leases  # noqa: F401  (app: celery -A finds it here)

LEASE = int(os.environ.get("CL_TEST_LEASE", "30"))

flow_metadata = sa.MetaData()
spans = sa.Table(
    "test_flow_spans",
    flow_metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("job_id", sa.String(36), nullable=False),
    sa.Column("kind", sa.String(50), nullable=False),
    sa.Column("tenant", sa.String(50)),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("pid", sa.Integer, nullable=False),
    sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("ended_at", sa.DateTime(timezone=True)),
)

_engines: dict[int, sa.Engine] = {}


def _engine() -> sa.Engine:
    # One per process: pool children must not share the parent's connections.
    if os.getpid() not in _engines:
        _engines[os.getpid()] = sa.create_engine(os.environ["CL_TEST_DB"], poolclass=sa.pool.NullPool)
    return _engines[os.getpid()]


def _span(ctx: JobContext, kind: str, payload: dict, body) -> dict:
    with _engine().begin() as conn:
        span = conn.execute(
            spans.insert()
            .values(
                job_id=ctx.job_id,
                kind=kind,
                tenant=payload.get("tenant"),
                attempt=ctx.attempt,
                pid=os.getpid(),
                started_at=sa.func.clock_timestamp(),
            )
            .returning(spans.c.id)
        ).scalar_one()
    out = body()
    with _engine().begin() as conn:
        conn.execute(spans.update().where(spans.c.id == span).values(ended_at=sa.func.clock_timestamp()))
    return out


def _work(ctx: JobContext, payload: dict) -> dict:
    """Sleep payload["sleep"], or until payload["release_file"] exists, cooperatively."""
    deadline = time.monotonic() + payload.get("sleep", 0.0)
    release = payload.get("release_file")
    while (release and not os.path.exists(release)) or time.monotonic() < deadline:
        ctx.raise_if_cancelled()
        time.sleep(0.02)
    return {"attempt": ctx.attempt}


@leases.job(kind="limited2", concurrency=2, max_attempts=1, lease_seconds=LEASE)
def limited2(ctx: JobContext, payload: dict) -> dict:
    return _span(ctx, "limited2", payload, lambda: _work(ctx, payload))


@leases.job(kind="per_tenant", concurrency=1, concurrency_key=lambda p: p["tenant"], max_attempts=1, lease_seconds=LEASE)
def per_tenant(ctx: JobContext, payload: dict) -> dict:
    return _span(ctx, "per_tenant", payload, lambda: _work(ctx, payload))


@leases.job(kind="rated", rate_limit=os.environ.get("CL_TEST_RATE", "4/s"), max_attempts=1)
def rated(ctx: JobContext, payload: dict) -> dict:
    return {"attempt": ctx.attempt}


@leases.job(kind="one_slot", concurrency=1, max_attempts=1, lease_seconds=LEASE)
def one_slot(ctx: JobContext, payload: dict) -> dict:
    return _span(ctx, "one_slot", payload, lambda: _work(ctx, payload))


@leases.job(kind="unlimited", max_attempts=1, lease_seconds=LEASE)
def unlimited(ctx: JobContext, payload: dict) -> dict:
    return _span(ctx, "unlimited", payload, lambda: _work(ctx, payload))


@leases.job(kind="snoozer", max_attempts=1)
def snoozer(ctx: JobContext, payload: dict) -> dict:
    """Snoozes payload["times"] times, counting in its checkpoint, then succeeds."""
    done = (ctx.checkpoint or {}).get("snoozed", 0)
    if done < payload["times"]:
        ctx.save_checkpoint({"snoozed": done + 1})
        ctx.snooze(payload["delay"])
    return {"snoozed": done, "attempt": ctx.attempt}


@leases.job(kind="chaos_limited", concurrency=2, max_attempts=6, lease_seconds=LEASE, retry_backoff=0.2, retry_backoff_max=1.0)
def chaos_limited(ctx: JobContext, payload: dict) -> dict:
    """Checkpointed steps, then one effect row written with the success."""

    def body() -> dict:
        start = (ctx.checkpoint or {}).get("i", 0)
        for i in range(start, payload["steps"]):
            ctx.raise_if_cancelled()
            time.sleep(payload["sleep"])
            ctx.save_checkpoint({"i": i + 1})
        ctx.effect(lambda conn: conn.execute(effects.insert().values(job_id=ctx.job_id, attempt=ctx.attempt, note="flow")))
        return {"resumed_from": start}

    return _span(ctx, "chaos_limited", payload, body)


@leases.job(kind="fair_import", fair=True, max_attempts=1, lease_seconds=LEASE)
def fair_import(ctx: JobContext, payload: dict) -> dict:
    """A fair kind (tests/e2e/test_flow.py): sleeps payload["sleep"] in its span."""
    return _span(ctx, "fair_import", payload, lambda: _work(ctx, payload))


# Batched kinds with flow control's limits (CLAIM_MANY_LIMITED): each batch is bounded
# by the free slots (per key) and the rate window.
@leases.job(kind="b_capped", batch=10, concurrency=2, max_attempts=1, lease_seconds=LEASE)
def b_capped(ctx: JobContext, payload: dict) -> dict:
    return _span(ctx, "b_capped", payload, lambda: _work(ctx, payload))


@leases.job(kind="b_rated", batch=10, rate_limit="5/s", max_attempts=1, lease_seconds=LEASE)
def b_rated(ctx: JobContext, payload: dict) -> dict:
    return _span(ctx, "b_rated", payload, lambda: _work(ctx, payload))


@leases.job(kind="b_keyed", batch=10, concurrency=1, concurrency_key=lambda p: p["tenant"], max_attempts=1, lease_seconds=LEASE)
def b_keyed(ctx: JobContext, payload: dict) -> dict:
    return _span(ctx, "b_keyed", payload, lambda: _work(ctx, payload))


@leases.job(kind="b_open", batch=10, max_attempts=1, lease_seconds=LEASE)
def b_open(ctx: JobContext, payload: dict) -> dict:
    return _span(ctx, "b_open", payload, lambda: _work(ctx, payload))
