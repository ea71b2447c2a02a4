"""Each named statement of db/statements/ against each status it may meet.

The rules: only a due pending job is claimable; every write of an attempt matches id,
running and its generation; revoking statements bump the generation; nothing ever
changes a terminal job.
"""

from __future__ import annotations

import pytest

from celery_lease.db.statements import attempt
from celery_lease.lifecycle import transition as tr
from celery_lease.lifecycle.claim import claim_delivery
from celery_lease.status import TERMINAL, Status
from tests.conftest import attempt_for

ALL = [s.value for s in Status]
TERMINALS = [s.value for s in TERMINAL]


@pytest.mark.parametrize("status", ALL)
def test_claim_takes_only_a_due_pending_job(store, add_job, row, status):
    job_id = add_job(status=status, lease_generation=4, attempt=1)
    claimed = claim_delivery(store, job_id, "node/1/boot", "tests.echo")
    if status == "pending":
        assert claimed is not None and claimed["lease_generation"] == 5 and claimed["attempt"] == 2
        r = row(job_id)
        assert (r["status"], r["lease_owner"]) == ("running", "node/1/boot")
        assert r["lease_expires_at"] is not None
        assert claim_delivery(store, job_id, "node/2/boot", "tests.echo") is None  # a duplicate delivery claims nothing
    else:
        assert claimed is None
        assert row(job_id)["status"] == status


def test_claim_matches_only_the_jobs_own_task(store, add_job, row):
    """A wakeup for another kind's task carrying this job's id claims nothing."""
    job_id = add_job()
    assert claim_delivery(store, job_id, "n/1/b", "tests.other_kind") is None
    r = row(job_id)
    assert (r["status"], r["attempt"], r["lease_generation"]) == ("pending", 0, 0)
    assert claim_delivery(store, job_id, "n/1/b", "tests.echo") is not None


def test_claim_waits_for_run_after(store, add_job):
    later = add_job(run_after_in=60)
    due = add_job(run_after_in=-1)
    assert claim_delivery(store, later, "n/1/b", "tests.echo") is None
    assert claim_delivery(store, due, "n/1/b", "tests.echo") is not None


@pytest.mark.parametrize("status", ALL)
def test_renew_holds_only_a_running_lease_of_the_same_generation(store, add_job, status):
    job_id = add_job(status=status, lease_generation=3, expires_in=10)
    held = store.renew([(job_id, 3), (job_id, 2)])
    assert held == ({(job_id, 3): True} if status == "running" else {})


def _ended(ending):
    """An attempt's write of one ending (END), as (statement, parameters)."""
    return lambda a: (attempt.end_jobs("sqlite"), tr.ending_params([ending(a)]))


@pytest.mark.parametrize(
    "write, final",
    [
        (_ended(lambda a: tr.Ending.succeeded(a, {"ok": 1})), "succeeded"),
        (_ended(lambda a: tr.Ending.failed(a, "boom")), "failed"),
        (_ended(lambda a: tr.Ending.retried(a, 5.0)), "pending"),
        (lambda a: (attempt.save_checkpoint(), {"new_checkpoint": {"i": 1}}), "running"),
        (lambda a: (attempt.publish_progress(), {"new_progress": {"rows": 1}}), "running"),
    ],
    ids=["complete", "fail", "retry", "checkpoint", "progress"],
)
@pytest.mark.parametrize("status", ALL)
def test_attempt_writes_are_fenced(store, add_job, row, write, final, status):
    job_id = add_job(status=status, lease_generation=7, attempt=1, expires_in=30)
    stale = attempt_for(job_id, 6)
    stmt, params = write(stale)
    assert stale.write(store, stmt, **params) is False
    assert stale.is_lost
    assert row(job_id)["status"] == status  # the stale write changed nothing
    live = attempt_for(job_id, 7)
    stmt, params = write(live)
    assert live.write(store, stmt, **params) is (status == "running")
    assert row(job_id)["status"] == (final if status == "running" else status)


@pytest.mark.parametrize("status", ALL)
def test_cancel_revokes_active_jobs_and_leaves_terminal_ones(lifecycle, add_job, row, status):
    job_id = add_job(status=status, lease_generation=2)
    cancelled = [str(r["id"]) for r in lifecycle.execute(tr.CANCEL, build={"job_id": job_id})]
    if status in ("pending", "running"):
        assert cancelled == [job_id]
        r = row(job_id)
        assert (r["status"], r["lease_generation"], r["lease_owner"]) == ("cancelled", 3, None)
    else:
        assert cancelled == []
        assert row(job_id)["status"] == status


def test_reap_requeues_expired_leases_and_expires_spent_ones(lifecycle, add_job, row):
    retry = add_job(status="running", attempt=1, expires_in=-1, lease_generation=1)
    spent = add_job(status="running", attempt=3, expires_in=-1, lease_generation=1)
    live = add_job(status="running", attempt=1, expires_in=60, lease_generation=1)
    done = add_job(status="succeeded", attempt=1, expires_in=-1)
    reaped = {r["id"]: r["status"] for r in lifecycle.execute(tr.REAP, {"limit": 100})}
    assert reaped == {retry: "pending", spent: "expired"}
    assert lifecycle.woken == [retry]  # the requeued job's wakeup, once
    assert row(spent)["error"] == "lease expired"
    assert row(retry)["lease_generation"] == 2 and row(retry)["lease_losses"] == 1
    assert row(live)["status"] == "running" and row(done)["status"] == "succeeded"


def test_reap_takes_at_most_its_batch(lifecycle, add_job):
    for _ in range(5):
        add_job(status="running", attempt=1, expires_in=-1)
    assert [len(lifecycle.execute(tr.REAP, {"limit": n})) for n in (2, 10, 10)] == [2, 3, 0]


def test_recover_requeues_only_this_nodes_earlier_boots(lifecycle, add_job, row):
    old = add_job(status="running", attempt=1, lease_owner="w1@h/10/oldboot")
    spent = add_job(status="running", attempt=3, lease_owner="w1@h/11/oldboot")
    now = add_job(status="running", attempt=1, lease_owner="w1@h/12/thisboot")
    other = add_job(status="running", attempt=1, lease_owner="w2@h/13/oldboot")
    owner = {"owner_prefix": "w1@h/", "owner_boot": "/thisboot"}
    rows = {r["id"]: r["status"] for r in lifecycle.execute(tr.RECOVER, build=owner)}
    assert rows == {old: "pending", spent: "failed"}
    assert row(spent)["error"] == "interrupted by restart"
    assert row(now)["status"] == row(other)["status"] == "running"


def test_sweep_stamps_only_due_pending_jobs_with_stale_wakeups(store, add_job, row):
    stale = add_job(woken_ago=120)
    stale_came_due = add_job(woken_ago=120, run_after_in=-60)
    never = add_job()
    came_due = add_job(run_after_in=-60)  # delayed, never woken, now due
    fresh = add_job(woken_ago=1)
    delayed = add_job(run_after_in=60)
    stale_delayed = add_job(woken_ago=120, run_after_in=60)
    held = add_job(woken_ago=120, held="limit")  # flow control wakes it, not the sweep
    running = add_job(status="running", woken_ago=120)
    untouched = [fresh, delayed, stale_delayed, held, running]
    before = [row(j)["woken_at"] for j in untouched]
    swept = {r["id"] for r in store.claim_due_wakeups(stale_seconds=30, limit=100)}
    assert swept == {stale, stale_came_due, never, came_due}
    assert store.claim_due_wakeups(stale_seconds=30, limit=100) == []  # stamped: not sent twice
    assert [row(j)["woken_at"] for j in untouched] == before


def test_sweep_limit_bounds_the_whole_statement(store, add_job):
    """The three kinds of due jobs (never woken, never woken and came due, woken long
    ago) share one :limit: each range takes what the ranges before it left."""
    due = {add_job(**kind) for kind in ({}, {"run_after_in": -60}, {"woken_ago": 120}) for _ in range(2)}
    batches = [{r["id"] for r in store.claim_due_wakeups(stale_seconds=30, limit=n)} for n in (1, 2, 3)]
    assert [len(b) for b in batches] == [1, 2, 3]
    assert set().union(*batches) == due
    assert store.claim_due_wakeups(stale_seconds=30, limit=3) == []


@pytest.mark.parametrize("status", ALL)
def test_prune_deletes_only_old_terminal_jobs(store, add_job, row, status):
    old = add_job(status=status, finished_ago=3600)
    young = add_job(status=status, finished_ago=1) if status in TERMINALS else None
    deleted = store.prune(older_than_seconds=60, limit=100)
    assert deleted == (1 if status in TERMINALS else 0)
    if young:
        assert row(young)["status"] == status
    if status not in TERMINALS:
        assert row(old)["status"] == status


def test_run_events_are_logged_with_the_transition(store, lifecycle, add_job):
    run_id = "00000000-0000-4000-8000-000000000001"
    store.ensure_run(run_id)
    job_id = add_job(run_id=run_id)
    claim_delivery(store, job_id, "n/1/b", "tests.echo")
    lifecycle.execute(tr.CANCEL, build={"run_id": run_id}, before=lambda conn: store.mark_run_cancelled(conn, run_id))
    events = [(e["event"], e["attempt"]) for e in store.run_events(run_id)]
    assert events == [("claimed", 1), ("cancelled", 1)]
    assert store.ensure_run(run_id) is False  # a cancelled run accepts no new jobs
