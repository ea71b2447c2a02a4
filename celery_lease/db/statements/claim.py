"""The claim family: every statement that moves a job from pending to running.

Every form of claim (plain, logged, with riding successes, limited, a priority swap, its
rate window's count) is built by ONE plain function, :func:`claim`, from the same parts;
:func:`adopt_claim` takes over the rows of a claim whose reply was lost, by its token.
The rule: a claim is one atomic UPDATE (``_claim_update``) that moves pending -> running
with attempt + 1 and lease_generation + 1, the returned generation being the attempt's
fencing token; each is durable (:mod:`celery_lease.db.durability`), so a token is never
issued twice, also across a crash of PostgreSQL. A job running elsewhere, terminal or not
due matches nothing (a duplicate delivery), and a job whose run is cancelled is made
``cancelled`` instead of started (the returned ``status`` says which).
"""

from __future__ import annotations

import functools
from typing import Any

import sqlalchemy as sa

from celery_lease.db.durability import durable
from celery_lease.db.schema import ID, jobs, pauses, runs
from celery_lease.db.statements.attempt import completed_events, completing
from celery_lease.db.statements.attempt_log import open_attempt
from celery_lease.db.statements.common import _PENDING, _c, _delivered, _due, db_now, db_now_plus
from celery_lease.db.statements.events import event_rows, events_cte, logged
from celery_lease.db.statements.fair import fair_head_job
from celery_lease.db.statements.flow import _rate_open_for, count_rate_claim
from celery_lease.db.statements.in_force import below_concurrency, not_overridden
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
    _c.status,
)

#: The detail of the run event of a job that a claim found in a cancelled run.
RUN_CANCELLED = "run cancelled"


@functools.cache
def claim(
    dialect: str = "postgresql", *, riding: bool = False, concurrency: bool = False, rate: bool = False, swap: bool = True
) -> Any:
    """The claim of the job a delivery names (:job_id, for task :wakeup_task, by :owner).

    * ``swap`` (always, but for the bench's baseline): flow control's guards: nothing
      of a paused kind is claimed, and the first due pending job of the same kind,
      queue and concurrency key with a higher priority is claimed in place of the
      delivered one (whose wakeup the caller sends again), or for a fair kind the first
      due pending job in fair order (statements/fair.py); without ``concurrency`` and
      ``rate``, nothing of a kind an operator's override limits either (the caller's
      view of which kinds are limited may be stale: it then claims on the limited path);
    * ``concurrency``: only while fewer jobs of the claimed job's kind and key run than
      its concurrency in force allows; ``rate``: only while the kind's rate window
      (:of_kind) takes a claim. Both read the kind's limits row, an operator's override
      included (in_force.in_force_*), after flow.lock_limits in the
      same transaction;
    * on PostgreSQL: ONE statement that also appends the run's event ('claimed', or
      'cancelled' for a job of a cancelled run) and, with ``rate``, counts the claim in
      the window (``window_claims``: the count after it; 1 means this claim opened the
      window): events.logs_itself. On SQLite the caller does both;
    * ``riding``: complete_jobs in the same statement (its attempt_params): a worker process's
      successes waiting in the completer ride on its next claim, one round trip and one durable commit
      for both. The parts touch different rows (a claim matches a pending job, a
      completion a running one) and each keeps its own guards. Always one row then:
      the claimed job's columns (all NULL when nothing was claimed) and
      ``completed``, the ids completed (NULL when none).
    """
    update = _claim_update(swap=swap, concurrency=concurrency, rate=rate)
    if dialect != "postgresql":
        assert not riding, "riding successes need the logged (PostgreSQL) claim"
        return durable(update)
    claimed = update.cte("claimed")
    cancelled = claimed.c.status == Status.CANCELLED.value
    event = sa.case((cancelled, sa.literal(Event.CANCELLED.value)), else_=sa.literal(Event.CLAIMED.value))
    detail = sa.case((cancelled, sa.literal(RUN_CANCELLED)), else_=sa.bindparam("owner", type_=sa.Text))
    columns: list[Any] = [claimed]
    rows = [event_rows(claimed, event, detail)]
    ctes = []
    if rate:
        started = sa.exists(sa.select(claimed.c.id).where(claimed.c.status == Status.RUNNING.value))
        counted = count_rate_claim().where(started).cte("counted")
        ctes.append(counted)
        columns.append(sa.select(counted.c.rate_claims).scalar_subquery().label("window_claims"))
        columns.append(sa.select(counted.c.window_rate).scalar_subquery().label("window_rate"))
    stmt = sa.select(*columns)
    if riding:
        done = completing().cte("completed")
        ctes.append(done)
        rows.append(completed_events(done))  # the same insert as the claim's own event
        completed = sa.select(sa.func.array_agg(sa.cast(done.c.id, sa.Text)).label("completed")).subquery("done_ids")
        stmt = stmt.add_columns(completed.c.completed).select_from(completed.outerjoin(claimed, sa.true()))
    return logged(durable(stmt.add_cte(events_cte("logged", *rows), *ctes)))


def _claim_update(*, swap: bool, concurrency: bool, rate: bool) -> sa.Update:
    """The UPDATE every claim is, with its guards: pending -> running for one attempt,
    atomically, attempt + 1 and lease_generation + 1 in the same statement. Guarded by
    the job's own task too (common._delivered: a wakeup is untrusted input)."""
    delivered = sa.bindparam("job_id", type_=ID)
    if swap:
        # A fair kind's delivery claims its kind's first job in fair order (fair.py); any
        # other kind's, a better-priority job or the delivered one. Chosen once (its
        # probes lock what they pick) and read by the run's lock and the update alike:
        # written out in both, the probes were planned, and paid for, twice.
        chosen = sa.select(sa.func.coalesce(fair_head_job(), _better_job(), delivered).label("id")).cte("target")
        target: Any = sa.select(chosen.prefix_with("MATERIALIZED").c.id).scalar_subquery()
    else:
        target = delivered
    # The run's row FOR SHARE: a claim racing a cancel_run that has marked the run but not
    # committed waits for it and sees the run cancelled; a later cancel_run waits for the
    # claim, then revokes it. (A cancelled run's job can exist: a child committed with its
    # parent's success, or a submit(run_id=R, connection=...) committed after cancel_run(R).)
    run = (
        sa.select(runs.c.cancelled_at.is_not(None).label("cancelled"))
        .select_from(runs.join(jobs, runs.c.id == _c.run_id))
        .where(_c.id == target)
        .with_for_update(read=True, of=runs)
        .cte("run")
        .prefix_with("MATERIALIZED")
    )
    # Read only while building the new row, so no job row is locked while it waits.
    cancelled = sa.func.coalesce(sa.select(run.c.cancelled).scalar_subquery(), sa.false())

    guards = [_delivered(target)]
    if swap:
        guards.append(~sa.exists().where(pauses.c.kind == _c.kind))
        if not (concurrency or rate):
            guards.append(not_overridden(_c.kind))
    if concurrency:
        guards.append(below_concurrency(_c.kind, _c.concurrency_key))
    if rate:
        guards.append(_rate_open_for(sa.bindparam("of_kind", type_=sa.String)))
    return sa.update(jobs).where(*guards).values(**claimed_values(cancelled)).returning(*CLAIMED_COLUMNS)


def claimed_values(cancelled: sa.ColumnElement[bool]) -> dict[str, Any]:
    """The new row of a claimed job (by :owner): running for one more attempt under a
    new generation, or, when ``cancelled`` (its run is), cancelled and never started."""

    def unless_cancelled(value, otherwise):
        return sa.case((cancelled, otherwise), else_=value)

    owner = sa.bindparam("owner", type_=_c.lease_owner.type)
    return {
        "status": unless_cancelled(sa.literal(Status.RUNNING.value), sa.literal(Status.CANCELLED.value)),
        "attempt": unless_cancelled(_c.attempt + 1, _c.attempt),
        "lease_generation": _c.lease_generation + 1,
        "lease_owner": unless_cancelled(owner, sa.null()),
        # The claim's identity: what a retry of this very claim adopts (adopt_claim).
        "claim_token": sa.bindparam("token", type_=_c.claim_token.type),
        "lease_expires_at": unless_cancelled(db_now_plus(_c.lease_seconds), sa.null()),
        "started_at": unless_cancelled(sa.func.coalesce(_c.started_at, db_now()), _c.started_at),
        "finished_at": unless_cancelled(_c.finished_at, db_now()),
        "held": sa.null(),  # a held job may be the one claimed
        "attempts": unless_cancelled(open_attempt(_c.attempt + 1, owner), _c.attempts),
        "updated_at": db_now(),
    }


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


@functools.cache
def adopt_claim() -> sa.Update:
    """adopt_claim: a claim whose reply was lost may have landed. The rows it claimed
    are running under its :owner with its own :token (one per claim call, the
    same for its retries): exactly what its first try took, never another row of this
    owner (one whose success waits to be written is running under it too). Restarts the
    lease of each from now, as the claim would have, and returns them."""
    return durable(
        sa.update(jobs)
        .where(
            _c.status == Status.RUNNING.value,
            _c.lease_owner == sa.bindparam("owner"),
            _c.claim_token == sa.bindparam("token", type_=_c.claim_token.type),
        )
        .values(lease_expires_at=db_now_plus(_c.lease_seconds), updated_at=db_now())
        .returning(*CLAIMED_COLUMNS)
    )
