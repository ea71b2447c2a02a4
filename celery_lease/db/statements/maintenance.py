"""The beat's and a worker start's statements: reaping elapsed leases, recovering
the jobs of a restarted worker node (both revoking, both requeueing), the sweep that
re-sends lost wakeups, and pruning finished jobs."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.sql.dml import ReturningDelete

from celery_lease.db.durability import durable
from celery_lease.db.schema import events, jobs
from celery_lease.db.statements.attempt_log import close_attempt
from celery_lease.db.statements.common import (
    _PENDING,
    _TERMINAL,
    REQUEUED_COLUMNS,
    WAKEUP_COLUMNS,
    _c,
    _chunk,
    _due,
    _lease_cleared,
    _lease_elapsed,
    _picked,
    _seconds,
    db_now,
    db_now_plus,
    epoch_seconds,
)
from celery_lease.db.statements.events import _events_of, logged
from celery_lease.status import AttemptOutcome, Event, Status


def _requeue_or(final: Status, ended: AttemptOutcome) -> dict[str, Any]:
    """Values that send a running job back to pending, or to ``final`` when its
    attempts are spent; its attempt ended as ``ended``. Bumps the generation: the old
    attempt is fenced out."""
    out_of_attempts = _c.attempt >= _c.max_attempts
    return {
        "status": sa.case((out_of_attempts, final.value), else_=Status.PENDING.value),
        "lease_generation": _c.lease_generation + 1,
        "lease_losses": _c.lease_losses + 1,
        "run_after": None,
        "woken_at": sa.case((out_of_attempts, None), else_=db_now()),
        "finished_at": sa.case((out_of_attempts, db_now()), else_=None),
        "updated_at": db_now(),
        "attempts": close_attempt(ended),
        **_lease_cleared,
    }


#: The run event detail of a reaped job is this, ": ", and its new status.
LEASE_EXPIRED = "lease expired"


@functools.cache
def reap_expired(dialect: str) -> sa.Update:
    """reap_expired: running jobs whose lease elapsed -> pending, or expired when their
    attempts are spent. Bounded by :limit; safe with several beats (SKIP LOCKED)."""
    values = _requeue_or(Status.EXPIRED, AttemptOutcome.LEASE_EXPIRED)
    values["error"] = sa.case((_c.attempt >= _c.max_attempts, sa.literal(LEASE_EXPIRED)), else_=_c.error)
    chunk = _chunk("expired", _lease_elapsed, _c.lease_expires_at, "limit")
    # Locked by this statement: still running and expired.
    return durable(sa.update(jobs).where(_picked(chunk, dialect)).values(**values).returning(*REQUEUED_COLUMNS))


@functools.cache
def any_lease_elapsed() -> sa.Select:
    """any_lease_elapsed: whether reap_expired would find a row. The reaper's idle tick
    is this one read of celery_lease_jobs_running (the index's own predicate, literal,
    so a generic plan uses it): no transaction id is taken and nothing is committed,
    where the reap transition's transaction takes one and commits durably (an fsync per
    idle tick). A lease that elapses just after it is reaped by the next tick."""
    return sa.select(sa.exists().where(_lease_elapsed).label("elapsed"))


@functools.cache
def reap_expired_logged() -> sa.Select:
    """reap_expired, plus the run's 'reaped' event of each reaped job that belongs to a
    run, as ONE statement (PostgreSQL data-modifying CTE): the store runs it prepared,
    in one round trip and its own transaction, and no event row is built in Python.
    The events are those Store.log_events would append (detail "lease expired: <status>")."""
    reaped = reap_expired("postgresql").cte("reaped")
    appended = _events_of(reaped, sa.literal(Event.REAPED.value), sa.literal(f"{LEASE_EXPIRED}: ") + reaped.c.status, "logged")
    return logged(durable(sa.select(reaped).add_cte(appended)))


def reap(dialect: str) -> Any:
    """The REAP transition's statement: reap_expired_logged on PostgreSQL, else reap_expired."""
    return reap_expired_logged() if dialect == "postgresql" else reap_expired(dialect)


def recover_restarted(owner_prefix: str, owner_boot: str) -> sa.Update:
    """recover_restarted: jobs left running by an earlier boot of this worker node.

    ``owner_prefix`` is "node/" and ``owner_boot`` is "/boot": rows owned by this node
    under another boot id were interrupted by the restart. (Literal values, not bind
    names: LIKE escaping of a node name that contains % or _ needs the string.)
    """
    where = sa.and_(
        _c.status == Status.RUNNING.value,
        _c.lease_owner.startswith(owner_prefix, autoescape=True),
        sa.not_(_c.lease_owner.endswith(owner_boot, autoescape=True)),
    )
    values = _requeue_or(Status.FAILED, AttemptOutcome.INTERRUPTED)
    values["error"] = sa.case((_c.attempt >= _c.max_attempts, sa.literal("interrupted by restart")), else_=_c.error)
    return durable(sa.update(jobs).where(where).values(**values).returning(*REQUEUED_COLUMNS))


def _count(chunk: sa.CTE) -> sa.ScalarSelect:
    return sa.select(sa.func.count()).select_from(chunk).scalar_subquery()


#: A wakeup re-sent again waits at most this many staleness thresholds (see _resend_due).
RESEND_BACKOFF_MAX = 4


def _resend_due() -> sa.ColumnElement[bool]:
    """A stale wakeup is re-sent once it has waited as long as its job had waited when it
    was woken (since the job's last change of state, or its run_after), at least
    :stale_seconds and at most RESEND_BACKOFF_MAX times that.

    Why: a wakeup not yet claimed is far more often queued behind a broker backlog than
    lost. Re-sent every threshold, a job waiting behind a backlog of D seconds gets
    D / threshold copies, every copy costs a worker a delivery, and a backlog longer
    than the threshold then grows faster than the workers drain it (a history run
    ended with 1,897 wakeups queued for 293 jobs, up to 15 copies of one). Doubling,
    it gets about log2(D / threshold) copies, then one per RESEND_BACKOFF_MAX
    thresholds. A job woken soon after it became pending (a submit, a retry or snooze
    coming due, a requeue) still gets its first re-send after one threshold."""
    stale = _seconds("stale_seconds")
    since = sa.case((_c.run_after > _c.updated_at, _c.run_after), else_=_c.updated_at)
    waited = epoch_seconds(_c.woken_at) - epoch_seconds(since)
    backoff = sa.case((waited > stale * RESEND_BACKOFF_MAX, stale * RESEND_BACKOFF_MAX), (waited > stale, waited), else_=stale)
    return epoch_seconds(db_now()) - epoch_seconds(_c.woken_at) >= backoff


@functools.cache
def claim_due_wakeups(dialect: str) -> sa.Update:
    """claim_due_wakeups: due pending jobs with no wakeup since :stale_seconds, at most :limit;
    ``resent`` tells a re-send (the job was woken before) from a first wakeup.

    Stamps woken_at before the caller publishes, so two beats never both send the
    same chunk, and a crash after this statement only delays the wakeup by one
    threshold.

    Due means pending, not held (flow control wakes held jobs when their cause ends:
    celery_lease.flow), run_after null or past, and woken_at null or older than :stale_seconds
    (and, for a wakeup re-sent before, than its backoff: _resend_due).
    That is three disjoint ranges of celery_lease_jobs_wakeup (woken_at, run_after),
    read in index order, each bounded by what is left of :limit: never woken and due
    at once; never woken and run_after past; woken before the threshold (run_after is
    then null or past but for rare rows, filtered). So a tick reads the rows it sends
    plus a few index pages, however many pending jobs were woken recently (each of them
    waits for its claim, not for the sweeper) or are delayed into the future.

    The status and held tests are literal SQL, the partial index's own predicate, so a
    generic plan uses the index too; the UPDATE probes the ids by primary key (_picked).
    """
    pending = sa.and_(_c.status == _PENDING, _c.held.is_(None))
    order = (_c.woken_at, _c.run_after)  # the index's order: a probe stops at :limit rows
    limit = sa.bindparam("limit", type_=sa.Integer)
    never = _chunk("never_woken", sa.and_(pending, _c.woken_at.is_(None), _c.run_after.is_(None)), order, limit)
    came_due = _chunk("came_due", sa.and_(pending, _c.woken_at.is_(None), _c.run_after <= db_now()), order, limit - _count(never))
    stale = sa.and_(pending, _c.woken_at < db_now_plus(-_seconds("stale_seconds")), _due(_c), _resend_due())
    rewake = _chunk("stale", stale, order, limit - _count(never) - _count(came_due))
    due = sa.union_all(*(sa.select(b.c.id) for b in (never, came_due, rewake))).cte("due")
    # ``resent``: the job had a wakeup before, which the broker may still hold (an IN, not
    # a correlated EXISTS: one hashed probe per row).
    resent = _c.id.in_(sa.select(rewake.c.id)).label("resent")
    # Locked by this statement: still pending and due.
    return sa.update(jobs).where(_picked(due, dialect)).values(woken_at=db_now()).returning(*WAKEUP_COLUMNS, resent)


@functools.cache
def prune_jobs(dialect: str) -> ReturningDelete:
    """prune_jobs: a bounded chunk of terminal jobs finished before :cutoff_seconds ago.

    Returns the ids deleted; the caller deletes their events in the same transaction.
    """
    old = sa.and_(_c.status.in_(_TERMINAL), _c.finished_at < db_now_plus(-_seconds("cutoff_seconds")))
    chunk = _chunk("prunable", old, _c.finished_at, "limit")
    # PostgreSQL: DELETE ... USING chunk (joined by key). SQLite has no USING; it has
    # no planner rescans either (and no row locks), so IN the chunk is the same there.
    where = _c.id == chunk.c.id if dialect == "postgresql" else _c.id.in_(sa.select(chunk.c.id))
    return sa.delete(jobs).where(where).returning(_c.id)


def delete_job_events(ids: Sequence[str]) -> sa.Delete:
    return sa.delete(events).where(events.c.job_id.in_(ids))
