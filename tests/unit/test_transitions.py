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
    assert {t.name for t in tr.ALL if t.lock_timeout is not None} == {"time out (retry)", "time out (fail)", "revoke", "reap"}
    assert len({t.name for t in tr.ALL}) == len(tr.ALL)  # each named once


def test_a_fenced_transition_of_a_lost_attempt_changes_nothing_and_follows_up_nothing(lifecycle, add_job, row):
    job_id = add_job(status="running", attempt=1, lease_generation=1, expires_in=30)
    stale = attempt_for(job_id, 1)
    stale.mark_lost()
    with pytest.raises(LeaseLost):
        lifecycle.execute(tr.HAND_OFF, attempt=stale)
    other = attempt_for(job_id, 2)  # a generation the row does not hold
    with pytest.raises(LeaseLost):
        lifecycle.execute(tr.HAND_OFF, attempt=other)
    assert other.lost.is_set() and row(job_id)["status"] == "running" and lifecycle.woken == []
    lifecycle.execute(tr.HAND_OFF, attempt=attempt_for(job_id, 1))
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
