"""The claim family: every statement that moves a job from pending to running.

claim_job is the claim; the others add to it (flow control's guards, the run event,
riding successes, a limited kind's checks) and adopt_claim takes over a claim whose
reply was lost.
"""

from __future__ import annotations

import functools
from typing import Any

import sqlalchemy as sa

from celery_lease.db.queries import _PENDING, _c, _delivered, _due, _events_of, complete_jobs, db_now, db_now_plus
from celery_lease.db.schema import ID, jobs, pauses, runs
from celery_lease.flow.statements import _rate_open_for, _running_like, count_rate_claim
from celery_lease.status import Event, Status

#: What a worker needs from a claimed job.
CLAIMED_COLUMNS = (
    _c.id,
    _c.kind,
    _c.attempt,
    _c.max_attempts,
    _c.lease_seconds,
    _c.lease_generation,
    _c.payload,
    _c.checkpoint,
    _c.run_id,
    _c.parent_id,
    _c.tenant,
    _c.canvas,
    # What a limited attempt's end frees: the slot of its kind and key.
    _c.concurrency_key,
    _c.queue,
    _c.trace_context,  # the submit's, parent of the attempt's span (celery_lease.tracing)
)

#: The detail of the run event of a job that a claim found in a cancelled run.
RUN_CANCELLED = "run cancelled"


@functools.cache
def claim_job() -> sa.Update:
    """claim_job: pending -> running for one attempt, atomically.

    attempt + 1 and lease_generation + 1 in the same statement: the generation
    returned is this attempt's fencing token. A job that is running elsewhere,
    terminal, or not due yet matches nothing: the delivery is a duplicate.

    Guarded by the job's own task too (queries._delivered).

    A job whose run is cancelled never starts: the same statement makes it
    ``cancelled`` instead (the returned ``status`` says which). Such a job can exist:
    a child committed with its parent's success, or a ``submit(run_id=R,
    connection=...)`` committed after ``cancel_run(R)`` looked at the run's jobs. The
    run's row is read FOR SHARE, so a claim racing a ``cancel_run`` that has marked
    the run but not yet committed waits for it and sees the run cancelled; a
    ``cancel_run`` that comes after the claim waits for the claim and then revokes it.
    """
    run = (
        sa.select(runs.c.cancelled_at.is_not(None).label("cancelled"))
        .select_from(runs.join(jobs, runs.c.id == _c.run_id))
        .where(_c.id == sa.bindparam("job_id"))
        .with_for_update(read=True, of=runs)
        .cte("run")
        .prefix_with("MATERIALIZED")
    )
    # Read only while building the new row, so no job row is locked while it waits.
    cancelled = sa.func.coalesce(sa.select(run.c.cancelled).scalar_subquery(), sa.false())

    def unless_cancelled(value, otherwise):
        return sa.case((cancelled, otherwise), else_=value)

    return (
        sa.update(jobs)
        .where(_delivered())
        .values(
            status=unless_cancelled(sa.literal(Status.RUNNING.value), sa.literal(Status.CANCELLED.value)),
            attempt=unless_cancelled(_c.attempt + 1, _c.attempt),
            lease_generation=_c.lease_generation + 1,
            lease_owner=unless_cancelled(sa.bindparam("owner", type_=_c.lease_owner.type), sa.null()),
            lease_expires_at=unless_cancelled(db_now_plus(_c.lease_seconds), sa.null()),
            started_at=unless_cancelled(sa.func.coalesce(_c.started_at, db_now()), _c.started_at),
            finished_at=unless_cancelled(_c.finished_at, db_now()),
            updated_at=db_now(),
        )
        .returning(*CLAIMED_COLUMNS, _c.status)
    )


@functools.cache
def adopt_claim() -> sa.Update:
    """adopt_claim: a claim retried after its reply was lost found the job running
    under this very owner: the lost claim had landed. Takes that attempt (its attempt
    number and generation) and restarts its lease from now, as the claim would have.

    The caller checks that no other attempt of this job lives in its process (the
    owner is one process): then the running row can only be that claim's.
    """
    return (
        sa.update(jobs)
        .where(_c.id == sa.bindparam("job_id"), _c.status == Status.RUNNING.value, _c.lease_owner == sa.bindparam("owner"))
        .values(lease_expires_at=db_now_plus(_c.lease_seconds), updated_at=db_now())
        .returning(*CLAIMED_COLUMNS, _c.status)
    )


def _claimed_and_logged() -> tuple[sa.CTE, sa.CTE]:
    """claim_job_flow as the CTE ``claimed``, and the CTE ``logged`` writing its run event."""
    claimed = claim_job_flow().cte("claimed")
    cancelled = claimed.c.status == Status.CANCELLED.value
    event = sa.case((cancelled, sa.literal(Event.CANCELLED.value)), else_=sa.literal(Event.CLAIMED.value))
    detail = sa.case((cancelled, sa.literal(RUN_CANCELLED)), else_=sa.bindparam("owner", type_=sa.Text))
    return claimed, _events_of(claimed, event, detail, "logged")


@functools.cache
def claim_job_logged() -> sa.Select:
    """claim_job, plus the run's 'claimed' event when the job belongs to a run, as ONE
    statement (PostgreSQL data-modifying CTE): the claim stays a single round trip
    and the event can never exist without the claim, nor the claim without it."""
    claimed, logged = _claimed_and_logged()
    return sa.select(claimed).add_cte(logged)


@functools.cache
def claim_job_completing(count: int) -> sa.Select:
    """claim_job_logged and complete_jobs(count) as ONE statement (PostgreSQL): a worker
    process's batched successes ride on its next claim, so a steady stream of jobs costs
    one round trip and one durable commit per job instead of two.

    The two parts touch different rows (a claim matches a pending job, a completion a
    running one) and each keeps its own guards; they commit together, synchronously.
    Always one row: the claimed job's columns (all NULL when nothing was claimed) and
    ``completed``, the ids completed (NULL when none), as complete_jobs returns them.
    """
    claimed, logged = _claimed_and_logged()
    done = complete_jobs(count).cte("completed")
    completed = sa.select(sa.func.array_agg(sa.cast(done.c.id, sa.Text)).label("completed")).subquery("done_ids")
    return (
        sa.select(claimed, completed.c.completed)
        .select_from(completed.outerjoin(claimed, sa.true()))
        .add_cte(logged)
        .add_cte(done)
    )


def _better_job() -> sa.ScalarSelect:
    """The job a delivery for :job_id claims instead: the first due pending job of the
    same kind, queue and concurrency key with a higher priority. NULL (claim :job_id)
    when there is none, or when :job_id is not itself due and pending (a stale
    delivery claims nothing, as before)."""
    named, best = jobs.alias("named"), jobs.alias("best")
    return (
        sa.select(best.c.id)
        .where(
            named.c.id == sa.bindparam("job_id", type_=ID),
            named.c.status == Status.PENDING.value,
            _due(named.c),
            best.c.status == _PENDING,
            best.c.priority > sa.literal_column("0"),
            best.c.priority > named.c.priority,
            best.c.kind == named.c.kind,
            best.c.queue.is_not_distinct_from(named.c.queue),
            best.c.concurrency_key.is_not_distinct_from(named.c.concurrency_key),
            _due(best.c),
        )
        .order_by(best.c.priority.desc(), best.c.created_at)
        .limit(1)
        .with_for_update(of=best, skip_locked=True)
        .scalar_subquery()
    )


_not_paused = ~sa.exists().where(pauses.c.kind == _c.kind)


@functools.cache
def claim_job_flow() -> sa.Update:
    """claim_job, under flow control: nothing of a paused kind is claimed, and a
    higher-priority due job of the same kind, queue and key is claimed in place of the
    delivered one (whose wakeup the caller sends again). Every other guard of
    claim_job applies unchanged, to the job actually claimed: this is claim_job with
    its target :job_id replaced, so a guard added there is inherited here."""
    target = sa.func.coalesce(_better_job(), sa.bindparam("job_id", type_=ID))

    def retarget(element):
        if isinstance(element, sa.BindParameter) and element.key == "job_id":
            return target
        return None

    # held is cleared by the claim itself (a held job may be the one claimed).
    stmt: Any = sa.sql.visitors.replacement_traverse(claim_job().values(held=sa.null()), {}, retarget)  # type: ignore[call-overload]
    return stmt.where(_not_paused)


@functools.cache
def claim_job_limited(concurrency: bool, rate: bool) -> sa.Update:
    """claim_job_flow for a limited kind, run after lock_limits in the same transaction:
    with ``concurrency``, only while fewer than :concurrency jobs of the claimed job's
    kind and key run; with ``rate``, only while the kind's rate window takes a claim."""
    stmt = claim_job_flow()
    if concurrency:
        stmt = stmt.where(_running_like(_c) < sa.bindparam("concurrency", type_=sa.Integer))
    if rate:
        stmt = stmt.where(_rate_open_for(sa.bindparam("of_kind", type_=sa.String)))
    return stmt


@functools.cache
def claim_job_limited_logged(concurrency: bool, rate: bool) -> sa.Select:
    """claim_job_limited, its run's 'claimed' event and (with ``rate``) the window's
    count, as ONE statement (PostgreSQL), like claim_job_logged. window_claims is the
    count after this claim (NULL without a rate)."""
    claimed = claim_job_limited(concurrency, rate).cte("claimed")
    logged = _events_of(claimed, sa.literal(Event.CLAIMED.value), sa.bindparam("owner", type_=sa.Text), "logged")
    stmt = sa.select(claimed).add_cte(logged)
    if not rate:
        return stmt.add_columns(sa.null().label("window_claims"))
    counted = count_rate_claim().where(sa.exists(sa.select(claimed.c.id))).cte("counted")
    return stmt.add_cte(counted).add_columns(sa.select(counted.c.rate_claims).scalar_subquery().label("window_claims"))
