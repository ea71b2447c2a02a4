"""Liveness rules that need no service: an attempt judges its lease by its own clock."""

from __future__ import annotations

import time

from celery_lease.worker.attempt import LAPSE_SHARE, Attempt
from tests.conftest import attempt_for


def _attempt(lease_seconds: int, renewed_ago: float) -> Attempt:
    job_id = "00000000-0000-0000-0000-000000000001"
    return attempt_for(job_id, lease_seconds=lease_seconds, renewed_at=time.monotonic() - renewed_ago)


class _NoStore:
    """A store that must not be reached: a lapsed attempt writes nothing."""

    def guarded(self, *args, **kwargs):
        raise AssertionError("a lapsed attempt reached the database")


def test_an_attempt_with_no_confirmed_renewal_for_most_of_its_lease_is_lost():
    assert not _attempt(10, renewed_ago=10 * LAPSE_SHARE - 1).is_lost
    lapsed = _attempt(10, renewed_ago=10 * LAPSE_SHARE + 0.01)
    assert lapsed.is_lost and lapsed.lost.is_set()


def test_a_lapsed_attempt_writes_nothing():
    lapsed = _attempt(3, renewed_ago=3)
    assert lapsed.write(_NoStore(), object()) is False


def test_the_lapse_counts_from_when_the_claim_was_sent():
    sent_at = time.monotonic() - 2.5
    row = {
        "lease_generation": 1,
        "attempt": 1,
        "max_attempts": 1,
        "lease_seconds": 3,
        "run_id": None,
        "parent_id": None,
        "tenant": None,
        "payload": {},
        "checkpoint": None,
    }
    assert Attempt.from_claim("j", row, sent_at=sent_at).is_lost
    assert not Attempt.from_claim("j", row).is_lost


def test_each_claiming_thread_owns_its_leases_under_its_own_name_and_the_process_is_known():
    """A threads pool's threads claim at once; a lost claim reply adopts the row under
    its own thread's owner (worker/executor.py), and a dead process's owners are all
    found by their pid (worker/lost.py)."""
    import os
    import threading

    from celery_lease.lifecycle.owner import BOOT_ID, owner_of, owner_pid

    main = owner_of("w@h")
    assert main == f"w@h/{os.getpid()}/{BOOT_ID}"
    seen: list[str] = []
    threads = [threading.Thread(target=lambda: seen.extend([owner_of("w@h"), owner_of("w@h")])) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(seen)) == 3 and all(seen[i] == seen[i + 1] for i in range(0, 6, 2))  # one name a thread
    assert {owner_pid(o) for o in [main, *seen]} == {os.getpid()}
    assert owner_pid("no-owner") is None and owner_pid("w/x.1/b") is None
