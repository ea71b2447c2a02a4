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
