"""An operator's override of a kind's limits, on SQLite: what LimitChange takes and
refuses, and that the limited claim, the hold and the wakes read the limit in force
(the override, else what the code declares) from the kind's limits row."""

from __future__ import annotations

import pytest

from celery_lease.flow.limits import DEFAULT, NO_LIMIT, LimitChange, Limits, Rate
from celery_lease.flow.store import FlowStore
from celery_lease.lifecycle import transition as tr
from tests.conftest import attempt_for, ended

OWNER = "node/1/boot"
TASK = "tests.echo"  # the task of the unit tier's add_job


@pytest.fixture
def flow(store):
    return FlowStore(store)


@pytest.mark.parametrize(
    "concurrency, rate, expected",
    [
        ("3", "1/h", LimitChange(concurrency=3, rate=Rate(1, 3600))),
        (2, "10/s", LimitChange(concurrency=2, rate=Rate(10, 1))),
        (None, "none", LimitChange(concurrency=NO_LIMIT, rate=NO_LIMIT)),  # JSON null: no limit
        ("default", "DEFAULT", LimitChange(concurrency=DEFAULT, rate=DEFAULT)),
    ],
)
def test_limit_change_parses_a_limit_none_and_default(concurrency, rate, expected):
    assert LimitChange.parse(concurrency=concurrency, rate=rate) == expected


def test_limit_change_leaves_out_what_was_not_given_and_refuses_nothing_to_change():
    assert LimitChange.parse(concurrency=None, rate="5/m", given=(False, True)) == LimitChange(rate=Rate(5, 60))
    with pytest.raises(ValueError, match="nothing to change"):
        LimitChange.parse(given=(False, False))


@pytest.mark.parametrize("bad", [0, -1, "0", "1.5", 1.5, True, "many", 1_000_001, ""])
def test_limit_change_refuses_a_bad_concurrency(bad):
    with pytest.raises(ValueError, match="concurrency must be"):
        LimitChange.parse(concurrency=bad, given=(True, False))


@pytest.mark.parametrize("bad", ["0/s", "10/d", "ten/s", 10, "", "1000001/s"])
def test_limit_change_refuses_a_bad_rate(bad):
    with pytest.raises(ValueError, match="rate limit"):
        LimitChange.parse(rate=bad, given=(False, True))


def claim(flow, job, limits=Limits(concurrency=2)):
    return flow.claim_limited(job, OWNER, "k", TASK, limits).row


def finish(flow, job):
    assert ended(flow._store, tr.Ending.succeeded(attempt_for(job, 1), None))


def test_a_concurrency_override_binds_the_next_claim_and_clearing_it_returns_to_the_code(flow, add_job, row):
    jobs = [add_job(kind="k") for _ in range(4)]
    assert claim(flow, jobs[0]) is not None  # code: concurrency 2
    flow.override("k", LimitChange(concurrency=1))
    result = flow.claim_limited(jobs[1], OWNER, "k", TASK, Limits(concurrency=2))
    assert (result.row, result.held) == (None, "limit")  # the code says 2; the override 1 binds
    flow.override("k", LimitChange(concurrency=DEFAULT))
    assert claim(flow, jobs[1]) is not None  # back to the code's 2
    assert claim(flow, jobs[2]) is None
    flow.override("k", LimitChange(concurrency=NO_LIMIT))  # explicitly none, whatever the code says
    assert claim(flow, jobs[2]) is not None and claim(flow, jobs[3]) is not None
    assert {row(j)["status"] for j in jobs} == {"running"}


def test_a_raised_override_frees_slots_for_the_held_to_be_woken(flow, add_job, row):
    jobs = [add_job(kind="k") for _ in range(3)]
    limits = Limits(concurrency=1)
    assert claim(flow, jobs[0], limits) is not None
    assert [claim(flow, j, limits) for j in jobs[1:]] == [None, None]
    assert flow.wake_for_slot("k", None) == []  # full
    flow.override("k", LimitChange(concurrency=3))
    assert sorted(str(w["id"]) for w in flow.top_up("k", None)) == sorted(jobs[1:])
    finish(flow, jobs[0])
    assert flow.held_keys("k") == []


def test_an_override_limits_a_kind_the_code_leaves_unlimited(flow, add_job):
    jobs = [add_job(kind="k") for _ in range(2)]
    flow.override("k", LimitChange(concurrency=1))  # creates the kind's limits row
    assert flow.overridden_kinds() == frozenset({"k"})
    assert flow.claim_limited(jobs[0], OWNER, "k", TASK, None).row is not None
    assert flow.claim_limited(jobs[1], OWNER, "k", TASK, None).held == "limit"
    flow.override("k", LimitChange(concurrency=DEFAULT))
    assert flow.overridden_kinds() == frozenset()


def test_a_rate_override_binds_the_window_and_a_new_length_starts_a_new_window(flow, add_job, row):
    jobs = [add_job(kind="k") for _ in range(5)]
    hourly = Limits(rate=Rate(3, 3600))
    assert claim(flow, jobs[0], hourly) is not None
    flow.override("k", LimitChange(rate=Rate(1, 3600)))  # same length: the window's claim counts
    assert flow.claim_limited(jobs[1], OWNER, "k", TASK, hourly).held == "rate"
    # jobs[1] carries the next hourly window's wakeup: due only then (await_window).
    assert row(jobs[1])["run_after"] is not None
    flow.override("k", LimitChange(rate=Rate(2, 60)))  # a new length: a new window of 2
    # What set_limits runs for each held key: the held carrier is due now.
    assert [str(w["id"]) for w in flow.top_up("k", None)] == [jobs[1]]
    assert row(jobs[1])["run_after"] is None
    assert claim(flow, jobs[1], hourly) is not None and claim(flow, jobs[2], hourly) is not None
    assert flow.claim_limited(jobs[3], OWNER, "k", TASK, hourly).held == "rate"
    flow.override("k", LimitChange(rate=NO_LIMIT))
    assert [str(w["id"]) for w in flow.top_up("k", None)] == [jobs[3]]  # no rate: every held job
    assert claim(flow, jobs[3], hourly) is not None and claim(flow, jobs[4], hourly) is not None


def test_changing_one_limit_leaves_the_other(flow, add_job):
    flow.override("k", LimitChange(concurrency=4, rate=Rate(7, 1)))
    flow.override("k", LimitChange(concurrency=DEFAULT))
    (stored,) = flow.limits_rows()
    assert (stored["concurrency_override"], stored["rate_override"], stored["per_seconds_override"]) == (None, 7, 1)
    assert flow.kind_exists("k") and not flow.kind_exists("other")
