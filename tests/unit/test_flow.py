"""Flow control on SQLite: the declarations (limits.py) and each flow statement.

The claim of a limited kind counts the running jobs of its kind and key under the
kind's limits row; a refused claim leaves the job pending and says why in ``held``;
a release wakes held jobs up to the free capacity, best priority first.
"""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from celery_lease.db.schema import limits as limits_table
from celery_lease.db.statements import attempt
from celery_lease.errors import InvalidPayload, JobSnoozed
from celery_lease.flow.limits import Limits, Rate, parse_priority
from celery_lease.flow.store import FlowStore
from celery_lease.lifecycle import transition as tr
from celery_lease.lifecycle.claim import claim_delivery
from celery_lease.status import AttemptOutcome
from celery_lease.worker.context import JobContext
from celery_lease.worker.heartbeat import Heartbeat
from tests.conftest import attempt_for, ended

OWNER = "node/1/boot"
TASK = "tests.echo"  # the task of the unit tier's add_job


@pytest.fixture
def flow(store):
    return FlowStore(store)


# --- declarations ------------------------------------------------------------------------


@pytest.mark.parametrize("text, count, per", [("20/s", 20, 1), ("100/m", 100, 60), ("1000/h", 1000, 3600), (" 5 / s ", 5, 1)])
def test_rate_parses_count_per_second_minute_hour(text, count, per):
    rate = Rate.parse(text)
    assert (rate.count, rate.per_seconds) == (count, per)
    assert Rate.parse(str(rate)) == rate


@pytest.mark.parametrize("text", ["20", "20/d", "0/s", "-1/s", "x/s", "20/sec", "", 20, None, "1.5/s"])
def test_rate_refuses_anything_else(text):
    with pytest.raises(ValueError, match="rate_limit"):
        Rate.parse(text)


def test_limits_declare_nothing_is_none_and_mistakes_raise_at_declaration():
    assert Limits.declare(None, None, None) is None
    assert Limits.declare(2, None, None) == Limits(concurrency=2)
    assert Limits.declare(None, None, "3/m").rate == Rate(3, 60)
    for bad in (0, -1, True, 1.5, "2"):
        with pytest.raises(ValueError, match="concurrency"):
            Limits.declare(bad, None, None)
    with pytest.raises(ValueError, match="needs concurrency"):
        Limits.declare(None, lambda p: p["t"], None)
    with pytest.raises(ValueError, match="function"):
        Limits.declare(1, "tenant", None)  # type: ignore[arg-type]


def test_concurrency_key_is_a_short_string_and_its_errors_carry_no_payload_text():
    limits = Limits.declare(1, lambda p: p["tenant"], None)
    assert limits is not None
    assert limits.key_for("fetch", {"tenant": "acme"}) == "acme"
    assert limits.key_for("fetch", {"tenant": 7}) == "7"
    assert limits.key_for("fetch", {"tenant": None}) is None
    with pytest.raises(InvalidPayload) as missing:
        limits.key_for("fetch", {"secret": "hunter2"})
    assert "KeyError" in str(missing.value) and "hunter2" not in str(missing.value) and "tenant" not in str(missing.value)
    for bad in ({"tenant": {"a": 1}}, {"tenant": True}, {"tenant": "x" * 256}):
        with pytest.raises(InvalidPayload):
            limits.key_for("fetch", bad)


@pytest.mark.parametrize("value", [0, 5, 255])
def test_priority_accepts_whole_numbers_from_zero(value):
    assert parse_priority(value) == value


@pytest.mark.parametrize("value", [-1, 256, True, 1.5, "5", None])
def test_priority_refuses_others(value):
    with pytest.raises(InvalidPayload, match="priority"):
        parse_priority(value)


# --- the limited claim -------------------------------------------------------------------


def test_concurrency_holds_the_claim_while_the_kind_is_full_and_a_release_wakes_it(flow, add_job, row):
    limits = Limits(concurrency=2)
    first, second = add_job(kind="k"), add_job(kind="k")
    assert flow.claim_limited(first, OWNER, "k", TASK, limits).row is not None
    assert flow.claim_limited(second, OWNER, "k", TASK, limits).row is not None
    third = add_job(kind="k")
    result = flow.claim_limited(third, OWNER, "k", TASK, limits)
    assert (result.row, result.held) == (None, "limit")
    r = row(third)
    assert (r["status"], r["attempt"], r["held"]) == ("pending", 0, "limit")  # no attempt spent
    assert flow.wake_for_slot("k", None) == []  # still full: nothing woken
    assert ended(flow._store, tr.Ending.succeeded(attempt_for(first, 1), None))
    woken = flow.wake_for_slot("k", None)
    assert [str(w["id"]) for w in woken] == [third]
    assert row(third)["held"] is None
    assert flow.claim_limited(third, OWNER, "k", TASK, limits).row is not None


def test_a_duplicate_delivery_of_a_limited_kind_is_neither_claimed_nor_held(flow, add_job, row):
    done = add_job(kind="k", status="succeeded")
    result = flow.claim_limited(done, OWNER, "k", TASK, Limits(concurrency=1))
    assert (result.row, result.held, result.retry) == (None, None, False)
    assert row(done)["held"] is None


def test_concurrency_key_limits_each_key_separately(flow, add_job, row):
    limits = Limits(concurrency=1, concurrency_key=lambda p: p["t"])
    a1, a2, b1 = (
        add_job(kind="k", concurrency_key="a"),
        add_job(kind="k", concurrency_key="a"),
        add_job(kind="k", concurrency_key="b"),
    )
    assert flow.claim_limited(a1, OWNER, "k", TASK, limits).row is not None
    assert flow.claim_limited(a2, OWNER, "k", TASK, limits).held == "limit"
    claimed = flow.claim_limited(b1, OWNER, "k", TASK, limits).row
    assert claimed is not None and claimed["concurrency_key"] == "b"  # a's backlog does not block b
    assert flow.wake_for_slot("k", "b") == []  # b's release wakes nothing of a
    assert row(a2)["held"] == "limit"


def test_release_wakes_held_jobs_best_priority_first_then_oldest(flow, add_job):
    limits = Limits(concurrency=1)
    running = add_job(kind="k")
    assert flow.claim_limited(running, OWNER, "k", TASK, limits).row is not None
    low_old, low_new, high = add_job(kind="k"), add_job(kind="k"), add_job(kind="k", priority=7)
    for job in (low_old, low_new, high):
        assert flow.claim_limited(job, OWNER, "k", TASK, limits).held is not None
    assert ended(flow._store, tr.Ending.failed(attempt_for(running, 1), "x"))
    assert [str(w["id"]) for w in flow.wake_for_slot("k", None)] == [high]


def test_rate_limit_counts_claims_per_window_and_schedules_one_wakeup_for_the_next(flow, add_job, row, store):
    limits = Limits(rate=Rate(2, 3600))
    jobs = [add_job(kind="r") for _ in range(4)]
    assert flow.claim_limited(jobs[0], OWNER, "r", TASK, limits).row is not None
    assert flow.claim_limited(jobs[1], OWNER, "r", TASK, limits).row is not None
    third = flow.claim_limited(jobs[2], OWNER, "r", TASK, limits)
    assert (third.row, third.held) == (None, "rate")
    assert third.later is not None and 0 <= third.later[0] <= 3600 and third.later[1]["id"] == jobs[2]
    fourth = flow.claim_limited(jobs[3], OWNER, "r", TASK, limits)
    assert fourth.held == "rate" and fourth.later is None  # one wakeup per window
    assert row(jobs[3])["attempt"] == 0
    # The window is spent: a release wakes nothing held for the rate.
    assert flow.top_up("r", None) == []
    # The third job carries the next window's wakeup: due only at that window's start.
    assert row(jobs[2])["run_after"] is not None
    # A new window (simulated: the stored one is moved back) lets two more through.
    with store.durable.begin() as conn:
        conn.execute(sa.update(limits_table).values(rate_window=limits_table.c.rate_window - 1))
    assert {str(w["id"]) for w in flow.top_up("r", None)} == {jobs[2], jobs[3]}
    assert row(jobs[2])["run_after"] is None  # woken: due now


def test_pause_holds_claims_of_that_kind_only_and_resume_wakes_them(flow, store, add_job, row):
    assert flow.pause("k") is True and flow.pause("k") is False
    paused = add_job(kind="k")
    other = add_job(kind="other")
    assert claim_delivery(store, paused, OWNER, TASK) is None
    assert flow.hold(paused, TASK).held == "pause"
    assert row(paused)["held"] == "pause"
    assert claim_delivery(store, other, OWNER, TASK) is not None
    limited = add_job(kind="k")
    assert flow.claim_limited(limited, OWNER, "k", TASK, Limits(concurrency=5)).held == "pause"
    assert flow.resume("k") is True
    assert {str(w["id"]) for w in flow.wake_all("pause", "k", chunk=1)} == {paused, limited}
    assert claim_delivery(store, paused, OWNER, TASK) is not None


def test_a_wakeup_for_another_task_neither_claims_nor_marks_the_job(flow, store, add_job, row):
    job = add_job(kind="k")
    flow.pause("k")
    assert claim_delivery(store, job, OWNER, "tests.other") is None
    assert flow.hold(job, "tests.other").held is None
    assert flow.claim_limited(job, OWNER, "k", "tests.other", Limits(concurrency=1)).held is None
    r = row(job)
    assert (r["status"], r["held"], r["woken_at"]) == ("pending", None, None)


def test_hold_of_a_claimable_job_asks_for_a_second_claim(flow, add_job, row):
    job = add_job(kind="k")
    result = flow.hold(job, TASK)
    assert (result.held, result.retry) == (None, True)


# --- priority ----------------------------------------------------------------------------


def test_a_claim_takes_a_higher_priority_due_job_of_the_same_kind_queue_and_key(store, add_job, row):
    low = add_job(kind="k")
    high = add_job(kind="k", priority=5)
    higher_later = add_job(kind="k", priority=9, run_after_in=60)  # not due
    other_kind = add_job(kind="other", priority=9)
    other_queue = add_job(kind="k", priority=9, queue="elsewhere")
    other_key = add_job(kind="k", priority=9, concurrency_key="x")
    claimed = claim_delivery(store, low, OWNER, TASK)
    assert claimed is not None and str(claimed["id"]) == high
    assert row(low)["status"] == "pending"  # its turn was taken; the caller re-wakes it
    for job in (higher_later, other_kind, other_queue, other_key):
        assert row(job)["status"] == "pending"
    again = claim_delivery(store, low, OWNER, TASK)
    assert again is not None and str(again["id"]) == low


def test_a_stale_delivery_swaps_in_nothing(store, add_job, row):
    done = add_job(kind="k", status="succeeded")
    high = add_job(kind="k", priority=5)
    assert claim_delivery(store, done, OWNER, TASK) is None
    assert row(high)["status"] == "pending"


# --- snooze and the sweeper --------------------------------------------------------------


def test_snooze_gives_the_attempt_back_and_keeps_the_checkpoint(store, add_job, row):
    job = add_job(kind="k", status="running", attempt=1, max_attempts=1, lease_generation=3, checkpoint={"i": 2})
    with store.durable.begin() as conn:
        end = attempt.end_jobs(store.dialect)
        stale, live = (tr.Ending(job, g, AttemptOutcome.SNOOZED, delay=30.0) for g in (2, 3))
        assert conn.execute(end, tr.ending_params([stale])).first() is None  # fenced
        assert conn.execute(end, tr.ending_params([live])).first() is not None
    r = row(job)
    assert (r["status"], r["attempt"], r["checkpoint"], r["lease_owner"]) == ("pending", 0, {"i": 2}, None)
    assert r["run_after"] is not None and r["woken_at"] is None
    assert claim_delivery(store, job, OWNER, TASK) is None  # not due for 30 s


@pytest.mark.parametrize("seconds", [-1, float("nan"), float("inf"), True, "30", 366 * 86400])
def test_snooze_refuses_a_bad_delay_at_the_call(store, seconds):
    ctx = _context(store)
    with pytest.raises(ValueError, match="snooze"):
        ctx.snooze(seconds)


def test_snooze_ends_the_body_with_its_delay(store):
    with pytest.raises(JobSnoozed) as snoozed:
        _context(store).snooze(30)
    assert snoozed.value.seconds == 30.0


def _context(store) -> JobContext:
    return JobContext(
        attempt_for("00000000-0000-4000-8000-000000000009", 1),
        store=store,
        producer=None,  # type: ignore[arg-type]
        registry=None,  # type: ignore[arg-type]
        heartbeat=Heartbeat(store, None),
        max_checkpoint_bytes=1000,
    )


def test_the_sweeper_leaves_held_jobs_to_flow_control(store, add_job):
    add_job(kind="k", held="limit", woken_ago=3600)
    plain = add_job(kind="k", woken_ago=3600)
    assert [str(r["id"]) for r in store.claim_due_wakeups(stale_seconds=30, limit=10)] == [plain]


def test_stale_held_groups_are_what_the_sweeper_recovers(flow, add_job):
    add_job(kind="k", held="limit", concurrency_key="a", woken_ago=120)
    add_job(kind="k", held="limit", concurrency_key="a", woken_ago=120)
    add_job(kind="k", held="pause", woken_ago=120)
    add_job(kind="fresh", held="limit", woken_ago=1)
    assert set(flow.stale_held_groups(30, 10)) == {("k", "a", "limit"), ("k", None, "pause")}


@pytest.mark.parametrize(
    "declared", [Limits(concurrency=5), Limits(rate=Rate(5, 3600))], ids=["rate-dropped", "concurrency-dropped"]
)
def test_jobs_held_by_limits_the_kind_no_longer_declares_are_recovered(flow, add_job, row, declared):
    running = add_job(kind="k")
    assert flow.claim_limited(running, OWNER, "k", TASK, Limits(concurrency=1, rate=Rate(1, 3600))).row is not None
    by_limit, by_rate = add_job(kind="k"), add_job(kind="k")
    assert flow.claim_limited(by_limit, OWNER, "k", TASK, Limits(concurrency=1)).held == "limit"
    assert flow.claim_limited(by_rate, OWNER, "k", TASK, Limits(rate=Rate(1, 3600))).held == "rate"
    # A new deployment drops one limit and loosens the other; its next claim declares
    # that in the row, and the sweeper's recovery wakes both held jobs.
    other = add_job(kind="k")
    assert flow.claim_limited(other, OWNER, "k", TASK, declared).row is not None
    assert {str(w["id"]) for w in flow.top_up("k", None)} == {by_limit, by_rate}


def test_the_wakeup_route_cache_is_bounded_whatever_queue_names_reach_it():
    """#19 item 10: routes are cached per (task, queue); queue names that keep changing
    (forged, or many tenants' queues) must not grow a worker's memory without end."""
    from celery import Celery

    from celery_lease.broker.wakeups import MAX_ROUTES, Publisher

    publisher = Publisher(Celery("bounded", broker="memory://"))
    for i in range(3 * MAX_ROUTES):
        publisher._route("tests.echo", f"forged-{i}")
    assert len(publisher._routes) <= MAX_ROUTES
