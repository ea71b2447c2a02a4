"""Flow control with real workers: two `celery worker` processes with two pool children
each, PostgreSQL and a private Redis. Every limit is measured from what the bodies
themselves recorded (test_flow_spans, database clock), not from what the claims say.
No beat runs unless a test says so: a held job must be woken by the release of a slot,
the next rate window or a resume, not by the sweeper.
"""

from __future__ import annotations

import math
import signal
from collections import Counter
from datetime import datetime

import pytest
import sqlalchemy as sa

from celery_lease import Status
from celery_lease.db.schema import jobs
from celery_lease.flow.fair import FairShare
from celery_lease.flow.limits import DEFAULT, LimitChange, Rate
from tests.apps.app import effects
from tests.apps.app_flow import flow_metadata, spans
from tests.conftest import wait_for

MODULE = "tests.apps.app_flow"


@pytest.fixture
def db(pg):
    engine = sa.create_engine(pg)
    flow_metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(spans.delete())
    yield engine
    engine.dispose()


@pytest.fixture
def fleet(pg, broker, workers, client_app):
    """fleet(conf=, extra_env=) -> the app module in this process, after starting two
    workers (-c 2 each) on it; they are in ``module.fleet``."""

    def start(conf: dict | None = None, extra_env: dict | None = None):
        mod = client_app(pg, broker, conf=conf, extra_env=extra_env, module=MODULE)
        mod.fleet = [
            workers(pg, broker, name=name, module=MODULE, concurrency=2, conf=conf, extra_env=extra_env) for name in ("w1", "w2")
        ]
        return mod

    return start


def span_rows(db, kind: str) -> list[dict]:
    with db.connect() as conn:
        stmt = sa.select(spans).where(spans.c.kind == kind).order_by(spans.c.started_at)
        return [dict(r) for r in conn.execute(stmt).mappings()]


def max_overlap(rows: list[dict], ended_default: datetime | None = None) -> int:
    """The most bodies running at one instant. An end and a start at the same instant
    do not overlap."""
    points = []
    for r in rows:
        end = r["ended_at"] or ended_default
        assert end is not None, f"span of {r['job_id']} never ended"
        points += [(r["started_at"], 1), (end, -1)]
    running = most = 0
    for _, step in sorted(points, key=lambda p: (p[0], p[1])):
        running += step
        most = max(most, running)
    return most


def job_rows(db, ids) -> dict[str, dict]:
    with db.connect() as conn:
        return {str(r["id"]): dict(r) for r in conn.execute(sa.select(jobs).where(jobs.c.id.in_(ids))).mappings()}


def wait_all(db, ids, status: str = "succeeded", timeout: float = 60, sweep=None) -> dict[str, dict]:
    def done():
        if sweep is not None:
            sweep()
        rows = job_rows(db, ids)
        return rows if all(r["status"] == status for r in rows.values()) else None

    return wait_for(done, timeout=timeout, interval=0.1, what=f"{len(ids)} jobs to be {status}")


def wait_held(db, ids, reason: str, timeout: float = 30) -> None:
    wait_for(
        lambda: all(r["held"] == reason for r in job_rows(db, ids).values()),
        timeout=timeout,
        what=f"{len(ids)} jobs held by {reason}",
    )


# --- concurrency -------------------------------------------------------------------------


def test_concurrency_is_a_limit_across_every_worker_and_held_jobs_wake_on_release(db, fleet):
    mod = fleet()
    ids = [j.id for j in mod.limited2.submit_many([{"sleep": 0.6}] * 8)]
    rows = wait_all(db, ids)
    assert max_overlap(span_rows(db, "limited2")) == 2  # four pool slots, never more than two bodies
    # Held jobs stayed pending and spent no attempt: each ran exactly once, as attempt 1.
    assert {r["attempt"] for r in rows.values()} == {1}
    assert len(span_rows(db, "limited2")) == 8


def test_concurrency_key_limits_each_key_and_one_keys_backlog_does_not_block_another(db, fleet):
    mod = fleet()
    ids = [mod.per_tenant.submit({"tenant": t, "sleep": 0.5}).id for t in ["a"] * 4 + ["b"] * 2]
    wait_all(db, ids)
    rows = span_rows(db, "per_tenant")
    assert max_overlap([r for r in rows if r["tenant"] == "a"]) == 1
    assert max_overlap([r for r in rows if r["tenant"] == "b"]) == 1
    # b's jobs ran beside a's backlog rather than after it.
    assert max_overlap(rows) == 2
    last_a_start = max(r["started_at"] for r in rows if r["tenant"] == "a")
    assert all(r["ended_at"] < last_a_start for r in rows if r["tenant"] == "b")


# --- rate --------------------------------------------------------------------------------


def test_rate_limit_bounds_claims_per_window_over_all_workers(db, fleet):
    mod = fleet(extra_env={"CL_TEST_RATE": "4/s"})
    ids = [j.id for j in mod.rated.submit_many([{}] * 14)]
    rows = wait_all(db, ids, timeout=60)  # no beat: each window's wakeup comes from the last one
    per_window = Counter(math.floor(r["started_at"].timestamp()) for r in rows.values())
    assert max(per_window.values()) <= 4, per_window
    assert len(per_window) >= 4
    assert {r["attempt"] for r in rows.values()} == {1}


# --- priority ----------------------------------------------------------------------------


def test_priority_orders_held_jobs_for_a_single_slot(db, fleet, tmp_path):
    mod = fleet()
    gate = tmp_path / "release-blocker"
    blocker = mod.one_slot.submit({"release_file": str(gate)})
    wait_for(lambda: span_rows(db, "one_slot"), what="the blocker to run")
    low = [mod.one_slot.submit({"n": i}).id for i in range(5)]
    high = mod.one_slot.submit({"n": "high"}, priority=5).id
    mid = mod.one_slot.submit({"n": "mid"}, priority=3).id
    wait_held(db, low + [high, mid], "limit")
    gate.touch()
    wait_all(db, [blocker.id, *low, high, mid])
    order = [r["job_id"] for r in span_rows(db, "one_slot")]
    assert order[:3] == [blocker.id, high, mid]
    assert sorted(order[3:]) == sorted(low)
    assert max_overlap(span_rows(db, "one_slot")) == 1


def test_a_high_priority_job_overtakes_a_backlog_as_soon_as_a_slot_frees(db, fleet):
    mod = fleet()
    backlog = [j.id for j in mod.unlimited.submit_many([{"sleep": 0.03}] * 150)]
    wait_for(lambda: len(span_rows(db, "unlimited")) >= 8, what="the backlog to start")
    high = mod.unlimited.submit({"sleep": 0}, priority=9).id
    wait_all(db, [high])
    rows = job_rows(db, [high, *backlog])
    submitted, started = rows[high]["created_at"], rows[high]["started_at"]
    overtaken_by = [i for i in backlog if rows[i]["started_at"] is not None and submitted < rows[i]["started_at"] < started]
    # At most the claims already under way when it was submitted (one per pool slot),
    # not the ~100 wakeups queued before it.
    assert len(overtaken_by) <= 4, len(overtaken_by)
    still_pending = [i for i in backlog if rows[i]["status"] == "pending"]
    assert still_pending, "the backlog drained before the high-priority job was submitted"
    wait_all(db, backlog)


# --- pause -------------------------------------------------------------------------------


def test_pause_survives_a_restart_lets_running_jobs_finish_and_resume_wakes_the_held(db, fleet, tmp_path):
    mod = fleet()
    gate = tmp_path / "release"
    running = mod.unlimited.submit({"release_file": str(gate)}).id
    wait_for(lambda: span_rows(db, "unlimited"), what="a job to run")
    assert mod.leases.pause("unlimited") is True
    held = [j.id for j in mod.unlimited.submit_many([{}] * 3)]
    wait_held(db, held, "pause")
    gate.touch()
    wait_all(db, [running])  # the running job finished under the pause
    # Restart the fleet: the pause is in the database, not in a worker.
    for worker in mod.fleet:
        worker.restart()
    mod.leases.sweep()  # the sweeper does not wake paused jobs either
    late = mod.unlimited.submit({}).id
    wait_held(db, [late], "pause")
    rows = job_rows(db, held + [late])
    assert {(r["status"], r["attempt"]) for r in rows.values()} == {("pending", 0)}
    assert mod.leases.resume("unlimited") == 4
    wait_all(db, held + [late])
    assert len(span_rows(db, "unlimited")) == 5


# --- snooze ------------------------------------------------------------------------------


@pytest.mark.parametrize("delay", [0, 0.3])
def test_snooze_any_number_of_times_with_max_attempts_1_still_succeeds(db, fleet, delay):
    mod = fleet()
    job = mod.snoozer.submit({"times": 3, "delay": delay})
    # A delayed snooze is due later: the sweeper (beat) wakes it, as it wakes retries.
    rows = wait_all(db, [job.id], sweep=mod.leases.sweep if delay else None)
    row = rows[job.id]
    assert row["result"] == {"snoozed": 3, "attempt": 1}
    assert (row["attempt"], row["max_attempts"], row["checkpoint"]) == (1, 1, None)
    # Each snooze gave its attempt back: four claims of attempt 1.
    assert [(a["attempt"], a["outcome"]) for a in row["attempts"]] == [(1, "snoozed")] * 3 + [(1, "succeeded")]


# --- cancel and faults -------------------------------------------------------------------


def test_a_cancelled_running_job_frees_its_slot_at_once(db, fleet, tmp_path):
    mod = fleet()
    first = mod.one_slot.submit({"release_file": str(tmp_path / "never")}).id
    wait_for(lambda: span_rows(db, "one_slot"), what="the first job to run")
    second = mod.one_slot.submit({}).id
    wait_held(db, [second], "limit")
    assert mod.leases.cancel(first)
    wait_all(db, [second])
    assert job_rows(db, [first])[first]["status"] == "cancelled"


def test_killed_workers_slots_come_back_when_reaped_and_the_limit_holds(db, pg, broker, workers, beats, client_app):
    conf = {"lease_reap_interval": 1, "lease_sweep_interval": 1, "lease_sweep_stale_seconds": 5}
    env = {"CL_TEST_LEASE": "3"}
    mod = client_app(pg, broker, conf=conf, extra_env=env, module=MODULE)
    # w1 runs alone until it is killed, so the jobs it is killed under are certain to exist;
    # w2 joins afterwards and the fleet has four pool slots for a limit of two.
    victim = workers(pg, broker, name="w1", module=MODULE, concurrency=2, conf=conf, extra_env=env)
    beats(pg, broker, conf=conf, module=MODULE)
    beats(pg, broker, conf=conf, module=MODULE)  # two beats reap and sweep side by side
    ids = [j.id for j in mod.chaos_limited.submit_many([{"steps": 6, "sleep": 0.25}] * 10)]

    def running_on_victim() -> list[str]:
        with db.connect() as conn:
            return [
                str(i)
                for i in conn.execute(
                    sa.select(jobs.c.id).where(jobs.c.status == "running", jobs.c.lease_owner.startswith("w1@"))
                ).scalars()
            ]

    def body_just_started_on_victim() -> bool:
        # A body that started under 0.5 s ago has a second of its 1.5 s left: the SIGKILL
        # lands while it runs, not after its success.
        with db.connect() as conn:
            fresh = conn.execute(
                sa.select(sa.func.count())
                .select_from(spans.join(jobs, sa.cast(jobs.c.id, sa.String) == spans.c.job_id))
                .where(
                    spans.c.kind == "chaos_limited",
                    spans.c.ended_at.is_(None),
                    spans.c.started_at > sa.func.clock_timestamp() - sa.text("interval '0.5 seconds'"),
                    jobs.c.status == "running",
                    jobs.c.lease_owner.startswith("w1@"),
                )
            ).scalar_one()
        return fresh > 0

    orphaned: list[str] = []
    for _ in range(3):
        wait_for(body_just_started_on_victim, timeout=30, what="a limited job starting on w1")
        victim.kill(signal.SIGKILL)
        with db.connect() as conn:
            killed_at = conn.execute(sa.select(sa.func.clock_timestamp())).scalar_one()
        orphaned = running_on_victim()  # w1's processes are dead: what still runs under it is orphaned
        victim.start()
        if orphaned:
            break
    workers(pg, broker, name="w2", module=MODULE, concurrency=2, conf=conf, extra_env=env)
    assert orphaned, "three kills of w1 orphaned no running job"
    cancelled = ids[-1]  # still held or queued: a cancel must work with limits on
    assert mod.leases.cancel(cancelled)
    rest = ids[:-1]
    wait_all(db, rest, timeout=120)
    with db.connect() as conn:
        effect_counts = Counter(r[0] for r in conn.execute(sa.select(effects.c.job_id).where(effects.c.job_id.in_(ids))))
    assert effect_counts == Counter({i: 1 for i in rest})  # 0 lost, 0 duplicated, none for the cancelled job
    assert job_rows(db, [cancelled])[cancelled]["status"] == Status.CANCELLED.value
    taken_back = job_rows(db, orphaned)
    assert all(taken_back[i]["lease_losses"] >= 1 for i in orphaned)  # the killed leases were taken back
    # The killed bodies stopped when w1 was killed; the limit held throughout.
    assert max_overlap(span_rows(db, "chaos_limited"), ended_default=killed_at) <= 2


# --- runtime limits: an operator's override ---------------------------------------------


def db_clock(db) -> datetime:
    with db.connect() as conn:
        return conn.execute(sa.select(sa.func.clock_timestamp())).scalar_one()


def overlap_after(rows: list[dict], since: datetime) -> int:
    """The most bodies running at one instant from ``since`` on."""
    return max_overlap([{**r, "started_at": max(r["started_at"], since)} for r in rows if r["ended_at"] > since])


def test_a_concurrency_override_binds_running_workers_survives_a_restart_and_clears_to_the_code(db, fleet):
    mod = fleet()
    before = [j.id for j in mod.limited2.submit_many([{"sleep": 0.5}] * 6)]
    wait_for(lambda: max_overlap(span_rows(db, "limited2"), db_clock(db)) == 2, what="two limited2 bodies at once")
    # The code says 2; the operator says 1, while the fleet runs them.
    assert mod.leases.flow.set_limits("limited2", LimitChange(concurrency=1))["concurrency"] == 1
    changed = db_clock(db)
    wait_all(db, before)
    rows = span_rows(db, "limited2")
    assert max_overlap([r for r in rows if r["started_at"] < changed]) == 2  # the code's 2 was in force
    # Once the bodies started before the change ended, never more than one.
    effect = max(r["ended_at"] for r in rows if r["started_at"] < changed)
    assert [r for r in rows if r["started_at"] > effect], "no body started after the change took effect"
    assert overlap_after(rows, effect) == 1
    # The override is in the database, not in a worker.
    for worker in mod.fleet:
        worker.restart()
    after_restart = [j.id for j in mod.limited2.submit_many([{"sleep": 0.3}] * 4)]
    wait_all(db, after_restart)
    assert max_overlap([r for r in span_rows(db, "limited2") if r["job_id"] in after_restart]) == 1
    # Cleared: the code's 2 binds again.
    assert mod.leases.flow.set_limits("limited2", LimitChange(concurrency=DEFAULT))["concurrency_source"] == "code"
    cleared = [j.id for j in mod.limited2.submit_many([{"sleep": 0.5}] * 6)]
    wait_all(db, cleared)
    assert max_overlap([r for r in span_rows(db, "limited2") if r["job_id"] in cleared]) == 2
    assert {r["attempt"] for r in job_rows(db, before + after_restart + cleared).values()} == {1}


def test_a_concurrency_override_limits_a_kind_the_code_leaves_unlimited_at_once(db, fleet):
    mod = fleet()
    free = [j.id for j in mod.unlimited.submit_many([{"sleep": 0.5}] * 4)]
    wait_all(db, free)
    assert max_overlap(span_rows(db, "unlimited")) >= 2  # the workers have claimed it unlimited
    mod.leases.flow.set_limits("unlimited", LimitChange(concurrency=1))
    # Right after the command returned, though the workers last read which kinds an
    # override limits up to OVERRIDES_REFRESH_SECONDS ago: their plain claim refuses
    # the kind, and they claim it on the limited path.
    limited = [j.id for j in mod.unlimited.submit_many([{"sleep": 0.3}] * 6)]
    rows = wait_all(db, limited)
    assert max_overlap([r for r in span_rows(db, "unlimited") if r["job_id"] in limited]) == 1
    assert {r["attempt"] for r in rows.values()} == {1}


def test_a_rate_override_binds_every_worker(db, fleet):
    mod = fleet(extra_env={"CL_TEST_RATE": "4/s"})
    mod.leases.flow.set_limits("rated", LimitChange(rate=Rate(2, 1)))
    ids = [j.id for j in mod.rated.submit_many([{}] * 10)]
    rows = wait_all(db, ids, timeout=60)
    per_window = Counter(math.floor(r["started_at"].timestamp()) for r in rows.values())
    assert max(per_window.values()) <= 2, per_window
    assert len(per_window) >= 5  # 10 claims at 2 a second (the code's 4/s would take 3 windows)


# --- fair share --------------------------------------------------------------------------


def ended_order(db, kind: str) -> list[dict]:
    """The spans of ``kind`` that ended, in the order they ended."""
    return sorted((r for r in span_rows(db, kind) if r["ended_at"] is not None), key=lambda r: r["ended_at"])


def test_fair_kind_a_late_tenants_jobs_finish_beside_a_bulk_import_not_after_it(db, pg, broker, workers, client_app):
    mod = client_app(pg, broker, module=MODULE)
    workers(pg, broker, name="w1", module=MODULE, concurrency=2)
    a = mod.fair_import.submit_many([{"tenant": "a", "sleep": 0.02}] * 400, tenant="a")
    b = mod.fair_import.submit_many([{"tenant": "b", "sleep": 0.02}] * 20, tenant="b")
    wait_all(db, [j.id for j in a + b], timeout=180)
    ended = ended_order(db, "fair_import")
    assert len(ended) == 420 and {r["attempt"] for r in ended} == {1}
    a_ends = [i for i, r in enumerate(ended) if r["tenant"] == "a"]
    last_b = max(i for i, r in enumerate(ended) if r["tenant"] == "b")
    # Every one of b's 20 ended before a's 120th. (The same kind without fair=True runs
    # them in submit order: all of them after a's 400th.)
    assert last_b < a_ends[119], (last_b, a_ends[119])


def test_fair_kind_shares_claims_by_weight(db, pg, broker, workers, client_app):
    mod = client_app(pg, broker, module=MODULE)
    fair = FairShare(mod.leases.store)
    fair.set_weight("a", 3)
    # Both backlogs are queued before the worker starts: neither had a head start.
    a = mod.fair_import.submit_many([{"tenant": "a", "sleep": 0.02}] * 300, tenant="a")
    b = mod.fair_import.submit_many([{"tenant": "b", "sleep": 0.02}] * 300, tenant="b")
    workers(pg, broker, name="w1", module=MODULE, concurrency=2)
    wait_for(lambda: len([r for r in span_rows(db, "fair_import") if r["ended_at"]]) >= 120, timeout=120, interval=0.2)
    first = ended_order(db, "fair_import")[:120]
    from_a = sum(1 for r in first if r["tenant"] == "a")
    assert 75 <= from_a <= 105, from_a
    assert {r["tenant"] for r in fair.tenants()} == {"a", "b"}
    wait_all(db, [j.id for j in a + b], timeout=180)


# --- batched kinds with limits -------------------------------------------------------------


def test_a_batched_kinds_concurrency_holds_across_every_worker(db, fleet):
    mod = fleet()
    ids = [j.id for j in mod.b_capped.submit_many([{"sleep": 0.2}] * 30)]
    rows = wait_all(db, ids, timeout=90)
    spans_ = span_rows(db, "b_capped")
    assert max_overlap(spans_) <= 2  # batch=10 and four pool slots, never more than two bodies
    assert len(spans_) == 30 and {r["attempt"] for r in rows.values()} == {1}


def test_a_batched_kinds_rate_limit_bounds_claims_per_window(db, fleet):
    mod = fleet()
    ids = [j.id for j in mod.b_rated.submit_many([{}] * 16)]
    rows = wait_all(db, ids, timeout=60)  # no beat: each window's wakeup comes from the last one
    per_window = Counter(math.floor(r["started_at"].timestamp()) for r in rows.values())
    assert max(per_window.values()) <= 5, per_window  # batch=10, rate 5/s
    assert len(per_window) >= 4
    assert {r["attempt"] for r in rows.values()} == {1}


def test_a_batched_kinds_concurrency_key_bounds_each_key(db, fleet):
    mod = fleet()
    ids = [j.id for j in mod.b_keyed.submit_many([{"tenant": t, "sleep": 0.2} for t in ["a"] * 6 + ["b"] * 4])]
    wait_all(db, ids, timeout=60)
    rows = span_rows(db, "b_keyed")
    assert max_overlap([r for r in rows if r["tenant"] == "a"]) == 1
    assert max_overlap([r for r in rows if r["tenant"] == "b"]) == 1
    assert len(rows) == 10


def test_an_operators_override_binds_a_batched_kind(db, fleet):
    mod = fleet()
    mod.leases.flow.set_limits("b_open", LimitChange(concurrency=1))
    # (A kind the code leaves unlimited: its workers read the overrides at most
    # OVERRIDES_REFRESH_SECONDS ago; the batch claim of such a kind takes no lock.)
    import time

    time.sleep(2.5)
    ids = [j.id for j in mod.b_open.submit_many([{"sleep": 0.2}] * 8)]
    rows = wait_all(db, ids, timeout=60)
    assert max_overlap([r for r in span_rows(db, "b_open") if r["job_id"] in ids]) == 1
    assert {r["attempt"] for r in rows.values()} == {1}
