"""The transition catalogue's rules, and the revoke queue's batching (no services)."""

from __future__ import annotations

import threading
import uuid

import pytest

from celery_lease.errors import LeaseLost
from celery_lease.lifecycle import transition as tr
from celery_lease.worker.revoke import Revoker
from tests.conftest import attempt_for


def test_every_transition_commits_durably_and_only_background_ones_bound_their_lock_waits():
    # Each ends an attempt or bumps a generation: an asynchronous commit lost in a
    # crash would undo it after its follow-ups were sent.
    assert all(t.durable for t in tr.ALL)
    assert {t.name for t in tr.ALL if t.lock_timeout is not None} == {"end (background)", "revoke", "reap"}
    assert len({t.name for t in tr.ALL}) == len(tr.ALL)  # each named once


def test_a_fenced_transition_of_a_lost_attempt_changes_nothing_and_follows_up_nothing(lifecycle, add_job, row):
    job_id = add_job(status="running", attempt=1, lease_generation=1, expires_in=30)
    stale = attempt_for(job_id, 1)
    stale.mark_lost()
    with pytest.raises(LeaseLost):
        lifecycle.execute(tr.END, tr.ending_params([tr.Ending.handed_off(stale)]), attempt=stale)
    other = attempt_for(job_id, 2)  # a generation the row does not hold
    with pytest.raises(LeaseLost):
        lifecycle.execute(tr.END, tr.ending_params([tr.Ending.handed_off(other)]), attempt=other)
    assert other.lost.is_set() and row(job_id)["status"] == "running" and lifecycle.woken == []
    live = attempt_for(job_id, 1)
    lifecycle.execute(tr.END, tr.ending_params([tr.Ending.handed_off(live)]), attempt=live)
    assert row(job_id)["status"] == "pending" and lifecycle.woken == [job_id]  # woken once


def test_a_revoke_broadcast_is_one_cancel_and_ids_that_are_not_jobs_cost_nothing():
    calls: list[list[str]] = []
    done = threading.Event()

    def cancel(ids: list[str]) -> list[str]:
        calls.append(ids)
        done.set()
        return []

    revoker = Revoker(cancel)
    ids = [str(uuid.uuid4()) for _ in range(3000)]
    revoker.submit(["not-a-job", "", *ids, "celery-task-42"])  # queued at once: one batch
    assert done.wait(5)
    revoker.submit(["only-garbage"])  # nothing to cancel: no call at all
    assert len(calls) == 1 and sorted(calls[0]) == sorted(ids)


def test_jobs_timing_out_together_are_one_statement_each_row_fenced(store, lifecycle, add_job, row):
    """Four attempts of one process time out at once: one ``end (background)`` statement writes
    them all (before: one transition per job, each its own round trip and commit). Each
    row keeps its own fence and outcome: attempts left -> retried with its own backoff,
    the last attempt -> failed, a lost lease -> untouched."""
    import sqlalchemy as sa

    from celery_lease.kinds import JobKind, Registry
    from celery_lease.worker.completion import InlineCompleter
    from celery_lease.worker.record import Recorder
    from celery_lease.worker.timeouts import Timeouts

    registry = Registry()
    registry.add(JobKind("echo", "tests.echo", lambda ctx, p: None, None, 3, 30, 2.0, 60.0, None, timeout=1))
    completer = InlineCompleter(lifecycle)
    recorder = Recorder(store, lifecycle._producer, registry, lifecycle, completer, canvas=None, flow=None, eager=False)
    first, second, last, lost = (
        add_job(status="running", attempt=n, lease_generation=n, expires_in=30, kind="echo") for n in (1, 2, 3, 1)
    )
    attempts = [
        attempt_for(first, 1, kind="echo"),
        attempt_for(second, 2, attempt=2, kind="echo"),
        attempt_for(last, 3, attempt=3, kind="echo"),
        attempt_for(lost, 7, kind="echo"),  # a generation the row does not hold: its lease was lost
    ]
    updates: list[str] = []

    def seen(conn, cursor, statement, *args):
        if statement.lstrip().upper().startswith("UPDATE CELERY_LEASE_JOBS"):
            updates.append(statement)

    sa.event.listen(store.durable, "before_cursor_execute", seen)
    try:
        Timeouts(recorder.time_out).submit(attempts)
        for attempt in attempts:
            assert attempt.lost.wait(10)  # each handler is stopped once the write landed
    finally:
        sa.event.remove(store.durable, "before_cursor_execute", seen)
    assert len(updates) == 1, updates
    assert [row(j)["status"] for j in (first, second, last, lost)] == ["pending", "pending", "failed", "running"]
    assert row(last)["error"] == "timed out" and row(first)["lease_owner"] is None
    # Each its own backoff by the database clock: 2 s, then 4 s, each with 0.5..1.5 jitter.
    for job_id, low, high in ((first, 1.0, 3.0), (second, 2.0, 6.0)):
        due = row(job_id)
        assert low - 0.01 <= (due["run_after"] - due["updated_at"]).total_seconds() <= high + 0.01


def test_the_dashboards_retry_and_delete_are_named_transitions_of_the_pipeline(store, lifecycle, add_job, row):
    """retry as new job: a new pending job, its dispatched event, woken once after the
    commit; the ended job is left as it was. delete: ended jobs only, with their events."""
    import sqlalchemy as sa

    from celery_lease.db.schema import events, jobs
    from celery_lease.ops.dashboard.actions import _DeletedEvents

    run_id = str(uuid.uuid4())
    failed = add_job(status="failed", attempt=3, run_id=run_id)
    running = add_job(status="running", attempt=1, lease_generation=1, expires_in=30)
    new_id = str(uuid.uuid4())
    (made,) = lifecycle.execute(tr.RETRY_AS_NEW, {"new_id": new_id, "job_id": failed}, build={"tenant": None})
    assert str(made["id"]) == new_id and lifecycle.woken == [new_id]
    assert row(new_id)["status"] == "pending" and str(row(new_id)["parent_id"]) == failed
    assert row(failed)["status"] == "failed"
    assert lifecycle.execute(tr.RETRY_AS_NEW, {"new_id": str(uuid.uuid4()), "job_id": running}, build={"tenant": None}) == []

    def events_of(job_id: str) -> list[str]:
        with store.durable.connect() as conn:
            return [r.event for r in conn.execute(sa.select(events.c.event).where(events.c.job_id == job_id))]

    assert events_of(new_id) == ["dispatched"]
    with store.durable.begin() as conn:  # the failed job's own history
        conn.execute(events.insert().values(run_id=run_id, job_id=failed, event="failed", attempt=3, created_at=sa.func.now()))
    deleted = lifecycle.execute(tr.DELETE, build={"ids": [failed, running], "tenant": None}, during=_DeletedEvents())
    assert [str(r["id"]) for r in deleted] == [failed] and events_of(failed) == []
    with store.durable.connect() as conn:
        left = {str(r.id) for r in conn.execute(sa.select(jobs.c.id))}
    assert left == {running, new_id} and lifecycle.woken == [new_id]


def test_every_claim_is_named_once_and_its_statement_declared_durable():
    from celery_lease.db import durability
    from celery_lease.lifecycle import claim as lc

    builds = {lc.CLAIM: {}, lc.CLAIM_LIMITED: {"concurrency": True, "rate": True}, lc.ADOPT: {}}
    assert set(builds) == set(lc.ALL) and len({c.name for c in lc.ALL}) == len(lc.ALL)
    for c, build in builds.items():
        for dialect in ("postgresql", "sqlite"):
            assert durability.is_durable(c.statement(dialect, **build)), (c.name, dialect)


def test_a_claims_follow_ups_run_once_after_it_committed(store, add_job, row):
    """A priority swap: the swapped-out delivery gets its follow-up, once, with the row
    claimed; a claim that took nothing sets off nothing."""
    from celery_lease.lifecycle.claim import ClaimFollowUps, claim_delivery

    low = add_job(task="tests.echo", priority=0)
    high = add_job(task="tests.echo", priority=5)
    swapped: list[str] = []
    follow_ups = ClaimFollowUps(swapped=lambda r: swapped.append(str(r["id"])), cancelled=lambda r: swapped.append("?"))
    claimed = claim_delivery(store, low, "n/1/b", "tests.echo", follow_ups=follow_ups)
    assert claimed is not None and str(claimed["id"]) == high and row(high)["status"] == "running"
    assert swapped == [high] and row(low)["status"] == "pending"
    assert claim_delivery(store, high, "n/1/b", "tests.echo", follow_ups=follow_ups) is None  # a duplicate
    assert swapped == [high]
