"""The tests' app plus the kinds of the history test (tests/e2e/test_history.py).

Every body records what it did in a separate history database (``CL_HISTORY_DB``: on
another server than the jobs', so neither a fault of the proxy in front of the jobs'
database nor a crash of that server touches the record, and the record's commits never
flush that server's WAL): a ``bodies`` row when it starts and when it ends, a ``writes``
row for each fenced write (``save_checkpoint``) that reported success. Its effect, one
row with its attempt and generation, is written in the job's own success transaction
(``ctx.effect``): it exists if and only if the success committed. tests/harness/history.py
reads both databases back and checks the history.
"""

from __future__ import annotations

import os
import time
import uuid

import sqlalchemy as sa

from celery_lease import Failure, JobContext
from tests.apps.app import app, leases  # noqa: F401  (app: celery -A finds it here)
from tests.apps.history_tables import bodies, effects, writes

LEASE = int(os.environ.get("CL_TEST_LEASE", "3"))
ATTEMPTS = 12  # attempts to spare: no job may run out of them under the faults
#: What every kind shares: attempts to spare, a short lease, quick retries.
COMMON = {"max_attempts": ATTEMPTS, "lease_seconds": LEASE, "retry_backoff": 0.1, "retry_backoff_max": 0.5}

_process: dict[int, tuple[sa.Engine, str]] = {}


def _recorder() -> tuple[sa.Engine, str]:
    """This process's engine on the history database and its holder name (a pool child
    must not share its parent's connections)."""
    pid = os.getpid()
    if pid not in _process:
        engine = sa.create_engine(os.environ["CL_HISTORY_DB"], poolclass=sa.pool.NullPool)
        _process[pid] = (engine, f"{pid}-{uuid.uuid4().hex[:8]}")
    return _process[pid]


def _record(stmt) -> int | None:
    """Run one recording statement, retrying through an outage of the history database: a
    record that cannot be written would make the history wrong, so it waits."""
    engine, _ = _recorder()
    deadline = time.monotonic() + 60
    while True:
        try:
            with engine.begin() as conn:
                result = conn.execute(stmt)
                return result.scalar() if result.returns_rows else None
        except sa.exc.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def generation_of(ctx: JobContext) -> int:
    token = getattr(ctx, "fencing_token", None)
    return int(token) if token is not None else ctx._attempt.generation  # type: ignore[attr-defined]


def _body(ctx: JobContext, kind: str, payload: dict, work, *, effect: bool = True) -> dict:
    """Record the body's start, run ``work``, record how it ended; ``effect``: write the
    effect row in the success transaction (without it, a plain success)."""
    _, holder = _recorder()
    generation = generation_of(ctx)
    row = _record(
        bodies.insert()
        .values(
            job_id=ctx.job_id,
            kind=kind,
            attempt=ctx.attempt,
            generation=generation,
            holder=holder,
            pid=os.getpid(),
            started_at=time.time(),
        )
        .returning(bodies.c.id)
    )
    outcome = "raised"
    try:
        out = work(generation, holder)
        outcome = "returned"
        if not effect:
            return out
        ctx.effect(
            lambda conn: conn.execute(
                effects.insert().values(
                    job_id=ctx.job_id, kind=kind, attempt=ctx.attempt, generation=generation, note=payload.get("note")
                )
            )
        )
        return out
    except Failure:
        outcome = "failed"
        raise
    except BaseException as exc:
        name = type(exc).__name__
        outcome = {"JobSnoozed": "snoozed", "JobCancelled": "cancelled", "JobSuspended": "suspended"}.get(name, "raised")
        raise
    finally:
        _record(bodies.update().where(bodies.c.id == row).values(ended_at=time.time(), outcome=outcome))


def _wrote(ctx: JobContext, generation: int, holder: str, step: int) -> None:
    """Record a fenced write the product accepted."""
    _record(writes.insert().values(job_id=ctx.job_id, generation=generation, holder=holder, step=step, at=time.time()))


def _steps(ctx: JobContext, payload: dict):
    """Checkpointed steps: each a fenced write, recorded when the product accepted it."""

    def work(generation: int, holder: str) -> dict:
        gate = payload.get("gate")  # a test holds the body here until the file exists
        while gate and not os.path.exists(gate):
            ctx.raise_if_cancelled()
            time.sleep(0.02)
        start = (ctx.checkpoint or {}).get("i", 0)
        for i in range(start, payload.get("steps", 2)):
            ctx.raise_if_cancelled()
            time.sleep(payload.get("sleep", 0.1))
            if ctx.save_checkpoint({"i": i + 1}):
                _record(
                    writes.insert().values(job_id=ctx.job_id, generation=generation, holder=holder, step=i + 1, at=time.time())
                )
        if payload.get("fail"):
            raise Failure("asked to fail")
        return {"n": payload.get("n", 0) + 1, "note": payload.get("note")}

    return work


def _chained(payload) -> dict:
    """A chain step gets the previous step's result (a dict) or a plain payload."""
    return payload if isinstance(payload, dict) else {"n": payload}


@leases.job(kind="h_plain", **COMMON)
def h_plain(ctx: JobContext, payload) -> dict:
    payload = _chained(payload)
    return _body(ctx, "h_plain", payload, _steps(ctx, payload))


@leases.job(kind="h_batch", batch=4, **COMMON)
def h_batch(ctx: JobContext, payload: dict) -> dict:
    """A batched kind (worker/many_claim.py) with plain successes: claimed, and completed, four
    at a time by one statement each. No effect row: its success is the row alone."""
    return _body(ctx, "h_batch", payload, _steps(ctx, payload), effect=False)


@leases.job(kind="h_limited", concurrency=2, **COMMON)
def h_limited(ctx: JobContext, payload: dict) -> dict:
    return _body(ctx, "h_limited", payload, _steps(ctx, payload))


@leases.job(kind="h_fair", fair=True, **COMMON)
def h_fair(ctx: JobContext, payload: dict) -> dict:
    """A fair kind: most of its claims swap in the first job of its fair order."""
    return _body(ctx, "h_fair", payload, _steps(ctx, payload))


@leases.job(kind="h_rated", rate_limit="5/s", **COMMON)
def h_rated(ctx: JobContext, payload: dict) -> dict:
    return _body(ctx, "h_rated", payload, _steps(ctx, payload))


@leases.job(kind="h_snooze", **COMMON)
def h_snooze(ctx: JobContext, payload: dict) -> dict:
    """Snoozes payload["times"] times (counted in its checkpoint), then succeeds."""

    def work(generation: int, holder: str) -> dict:
        done = (ctx.checkpoint or {}).get("snoozed", 0)
        if done < payload.get("times", 2):
            if ctx.save_checkpoint({"snoozed": done + 1}):
                _record(
                    writes.insert().values(job_id=ctx.job_id, generation=generation, holder=holder, step=done + 1, at=time.time())
                )
            ctx.snooze(payload.get("delay", 0.2))
        return {"snoozed": done}

    return _body(ctx, "h_snooze", payload, work)


@leases.job(kind="h_timeout", concurrency=2, timeout=1, **COMMON)
def h_timeout(ctx: JobContext, payload: dict) -> dict:
    """Attempt 1 overruns its 1 s timeout (cooperatively, polling its stop point, or
    not); later attempts return at once."""

    def work(generation: int, holder: str) -> dict:
        if ctx.attempt == 1:
            deadline = time.monotonic() + payload.get("seconds", 2.5)
            while time.monotonic() < deadline:
                if payload.get("cooperative"):
                    ctx.raise_if_cancelled()
                time.sleep(0.05)
        return {"attempt": ctx.attempt}

    return _body(ctx, "h_timeout", payload, work)


@leases.job(kind="h_sum", **COMMON)
def h_sum(ctx: JobContext, payload: list) -> dict:
    """A chord body: the sum of the header's n."""
    total = sum(_chained(item).get("n", 0) for item in payload)
    return _body(ctx, "h_sum", {"note": str(total)}, lambda generation, holder: {"n": total})


@leases.job(kind="h_errback", **COMMON)
def h_errback(ctx: JobContext, payload: dict) -> dict:
    """A leased errback: its effect's note is the failed job's id."""
    return _body(ctx, "h_errback", {"note": payload["job_id"]}, lambda generation, holder: {"failed": payload["job_id"]})
