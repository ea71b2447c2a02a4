"""The history checker (tests/harness/history.py) on hand-made histories: a clean history
passes, and each kind of violation is found and shown."""

from __future__ import annotations

import pytest

from tests.harness.history import History, Op, check, excerpt, report

T0 = 1_000_000.0
OWNER = "w1@testhost/100/boot"


def job(job_id: str, kind: str = "h_plain", status: str = "succeeded", attempt: int = 1, generation: int = 1, **extra) -> dict:
    return {
        "id": job_id,
        "kind": kind,
        "status": status,
        "attempt": attempt,
        "lease_generation": generation,
        "error": None,
        "parent_id": None,
        "canvas": None,
        "payload": {},
        "created_at": T0,
        "finished_at": T0 + 10,
        **extra,
    }


def body(
    job_id: str,
    attempt: int = 1,
    generation: int = 1,
    holder: str = "100-a",
    start: float = 1.0,
    end: float | None = 2.0,
    **extra,
):
    return {
        "job_id": job_id,
        "kind": extra.pop("kind", "h_plain"),
        "attempt": attempt,
        "generation": generation,
        "holder": holder,
        "pid": int(holder.split("-")[0]),
        "started_at": T0 + start,
        "ended_at": None if end is None else T0 + end,
        "outcome": extra.pop("outcome", "returned"),
    }


def claimed(job_id: str, attempt: int = 1, at: float = 0.9, owner: str = OWNER) -> dict:
    return {"job_id": job_id, "event": "claimed", "attempt": attempt, "detail": owner, "at": T0 + at}


def effect(job_id: str, attempt: int = 1, generation: int = 1) -> dict:
    return {"job_id": job_id, "kind": "h_plain", "attempt": attempt, "generation": generation, "note": None}


def clean() -> History:
    return History(
        ops=[Op(T0, "submit", "a"), Op(T0, "submit", "b")],
        jobs={"a": job("a"), "b": job("b", attempt=2, generation=2)},
        events=[claimed("a"), claimed("b", 1), claimed("b", 2, at=5.0)],
        bodies=[body("a"), body("b", 1, 1, end=None), body("b", 2, 2, holder="200-b", start=5.1, end=6.0)],
        writes=[{"job_id": "b", "generation": 1, "holder": "100-a", "step": 1, "at": T0 + 1.5}],
        effects=[effect("a"), effect("b", 2, 2)],
        concurrency={"h_limited": 1},
        rates={"h_rated": (2, 1)},
        effect_kinds=frozenset({"h_plain", "h_limited", "h_rated", "h_errback", "h_sum"}),
        pid_kills={100: T0 + 3.0},
        node_kills={"w1@testhost": [T0 + 3.0]},
    )


def checks(h: History) -> list[str]:
    return sorted({v.check for v in check(h)})


def test_a_clean_history_passes():
    assert check(clean()) == []


def test_a_worker_that_ended_on_its_own():
    h = clean()
    h.ended_workers = ["w2"]
    assert checks(h) == ["worker"]


def test_a_submitted_job_without_a_row_is_lost():
    h = clean()
    h.ops.append(Op(T0, "submit", "gone"))
    assert checks(h) == ["lost"]


def test_a_job_left_running_is_not_terminal():
    h = clean()
    h.jobs["a"]["status"] = "running"
    h.effects = [e for e in h.effects if e["job_id"] != "a"]
    assert checks(h) == ["terminal"]


def test_an_expired_job_nobody_cancelled_is_a_wrong_outcome():
    h = clean()
    h.jobs["a"]["status"] = "expired"
    h.effects = [e for e in h.effects if e["job_id"] != "a"]
    assert checks(h) == ["outcome"]


def test_a_cancel_that_returned_true_must_end_cancelled():
    h = clean()
    h.ops.append(Op(T0 + 0.5, "cancel", "a", {"returned": True}))
    assert checks(h) == ["outcome"]


@pytest.mark.parametrize("case", ["twice", "none", "stale", "not_succeeded"])
def test_effects_exactly_once_and_of_the_final_attempt(case):
    h = clean()
    if case == "twice":
        h.effects.append(effect("a"))
    elif case == "none":
        h.effects = [e for e in h.effects if e["job_id"] != "a"]
    elif case == "stale":
        h.effects = [effect("a"), effect("b", 1, 1)]
    else:
        h.jobs["a"]["status"] = "cancelled"
        h.ops.append(Op(T0, "revoke", "a"))
    assert checks(h) == ["effect"]


def test_two_holders_of_one_generation():
    h = clean()
    # After a crash the row went back to generation 0, and the job was claimed again.
    h.bodies.append(body("b", 1, 1, holder="300-c", start=3.5, end=4.0))
    h.writes.append({"job_id": "b", "generation": 1, "holder": "300-c", "step": 1, "at": T0 + 3.6})
    h.events.append(claimed("b", 1, at=3.4, owner="w2@testhost/300/boot"))
    found = check(h)
    assert {v.check for v in found} == {"fencing"}
    assert any("fenced write" in v.message for v in found) and any("ran a body" in v.message for v in found)


def test_an_attempt_spent_without_a_body():
    h = clean()
    h.jobs["a"].update(attempt=2, lease_generation=2)
    h.events.append(claimed("a", 2, at=3.5, owner="w2@testhost/300/boot"))
    h.effects = [effect("a", 2, 2), effect("b", 2, 2)]
    h.bodies.append(body("a", 2, 2, holder="300-c", start=3.6, end=4.0))
    h.events.append(claimed("a", 1, at=2.5, owner="w2@testhost/300/boot"))  # a second claim of attempt 1...
    assert check(h) == []  # ...still has a body (attempt 1 ran)
    h.bodies = [b for b in h.bodies if not (b["job_id"] == "a" and b["attempt"] == 1)]
    assert checks(h) == ["attempt"]


def test_a_claim_whose_owner_was_killed_is_excused():
    h = clean()
    h.jobs["a"].update(attempt=2, lease_generation=2)
    h.effects = [effect("a", 2, 2), effect("b", 2, 2)]
    h.bodies = [b for b in h.bodies if b["job_id"] != "a"] + [body("a", 2, 2, holder="300-c", start=6, end=7)]
    h.events = [claimed("a", 1, at=2.9), claimed("a", 2, at=6.0), *[e for e in h.events if e["job_id"] != "a"]]
    assert check(h) == []  # w1 was killed at +3.0, right after claiming attempt 1
    h.events[0] = claimed("a", 1, at=2.9, owner="w2@testhost/300/boot")
    assert checks(h) == ["attempt"]
    # A claim delayed in flight commits after its process died: excused as well.
    h.events[0] = claimed("a", 1, at=4.0)
    assert check(h) == []


def test_a_claim_held_until_its_process_was_killed_before_the_reap_is_excused():
    """history[prepared] seed 674547: a rate-limited claim's follow-up was held by the
    proxy, and the child, its body not started, was killed 1.57 s after the claim; the
    reaper spent the attempt. A process that dies holding a claim spends its attempt
    however long it held it, up to the reap; a kill after the reap excuses nothing."""
    h = clean()
    h.jobs["a"].update(attempt=2, lease_generation=2)
    h.effects = [effect("a", 2, 2), effect("b", 2, 2)]
    h.bodies = [b for b in h.bodies if b["job_id"] != "a"] + [body("a", 2, 2, holder="300-c", start=7, end=8)]
    h.node_kills = {}
    h.pid_kills = {300: T0 + 4.0}
    owner = "w2@testhost/300/boot"
    others = [e for e in clean().events if e["job_id"] != "a"]
    h.events = [claimed("a", 1, at=2.4, owner=owner), claimed("a", 2, at=7.0), *others]
    assert checks(h) == ["attempt"]  # not reaped: only the 1.5 s after the claim count
    reap = {"job_id": "a", "event": "reaped", "attempt": 1, "detail": "lease expired: pending", "at": T0 + 4.1}
    h.events.append(reap)
    assert check(h) == []
    h.events[-1] = {**reap, "at": T0 + 3.95}  # reaped before the kill
    assert checks(h) == ["attempt"]


@pytest.mark.parametrize(
    "fault",
    [
        {"fault": "partition", "seconds": 4.0},  # seed 25805
        {"fault": "pg_crash"},  # seed 987532
        {"fault": "kill_backend", "pid": 1234},  # seed 639886: crash recovery, the claim's worker refused
    ],
)
def test_a_claim_cut_off_by_an_outage_longer_than_the_lease_is_excused(fault):
    """An outage that begins just after a claim and outlasts its lease: the claim's COMMIT
    reply lost as the proxy pauses (partition: the worker cannot learn it holds the job),
    or a claim whose reply came too late, handed off into a PostgreSQL crash (the
    hand-off cannot land while the server recovers). Either way the reaper spends the
    attempt without a body; an outage over before the claim excuses nothing."""
    h = clean()
    h.jobs["a"].update(attempt=2, lease_generation=2)
    h.effects = [effect("a", 2, 2), effect("b", 2, 2)]
    h.bodies = [b for b in h.bodies if b["job_id"] != "a"] + [body("a", 2, 2, holder="300-c", start=9, end=10)]
    h.events = [
        claimed("a", 1, at=7.0, owner="w2@testhost/300/boot"),
        claimed("a", 2, at=9.0),
        *[e for e in h.events if e["job_id"] != "a"],
    ]
    assert checks(h) == ["attempt"]
    h.ops.append(Op(T0 + 7.1, "fault", None, fault))
    assert check(h) == []
    h.ops[-1] = Op(T0 + 6.95, "fault", None, fault)  # recorded as it began, acting after the claim (seed 801828)
    assert check(h) == []
    h.ops[-1] = Op(T0 + 6.0, "fault", None, fault)  # began before the claim
    assert checks(h) == ["attempt"]


def test_a_job_without_claim_events_is_excused_an_attempt_per_outage_in_its_life():
    """A batched job outside a run logs no claim: its claim's reply cut off by a partition
    longer than the lease spends an attempt without a body (seed 218077)."""
    h = clean()
    h.jobs["c"] = job("c", kind="h_batch", attempt=2, generation=2, finished_at=T0 + 20)
    h.bodies.append(body("c", 2, 2, holder="300-c", start=12, end=12.1, kind="h_batch"))
    h.pid_kills, h.node_kills = {}, {}
    h.events = [claimed("a"), claimed("b", 1), claimed("b", 2, at=5.0)]
    assert "attempt" in checks(h)
    h.ops.append(Op(T0 + 8.0, "fault", None, {"fault": "partition", "seconds": 4.0}))
    assert "attempt" not in checks(h)
    h.ops[-1] = Op(T0 + 30.0, "fault", None, {"fault": "partition", "seconds": 4.0})  # after it finished
    assert "attempt" in checks(h)


def test_a_threads_claim_delayed_past_its_process_death_is_excused():
    """A threads pool's claim names its thread (node/pid.T/boot): the process is the pid
    before the dot (history[threads] seed 150679 flagged such a claim, landed 1.5 s
    after its process was killed, as an attempt spent without a body)."""
    h = clean()
    h.jobs["a"].update(attempt=2, lease_generation=2)
    h.effects = [effect("a", 2, 2), effect("b", 2, 2)]
    h.bodies = [b for b in h.bodies if b["job_id"] != "a"] + [body("a", 2, 2, holder="300-c", start=6, end=7)]
    h.node_kills = {}  # only the process's own kill can excuse it
    h.events = [claimed("a", 1, at=4.5, owner="w1@testhost/100.4/boot"), claimed("a", 2, at=6.0)]
    h.events += [e for e in clean().events if e["job_id"] != "a"]
    assert check(h) == []
    h.events[0] = claimed("a", 1, at=4.5, owner="w1@testhost/101.4/boot")  # another process
    assert checks(h) == ["attempt"]


def test_a_snooze_that_spent_an_attempt():
    h = clean()
    h.jobs["s"] = job("s", kind="h_snooze", attempt=2, generation=2)
    h.effects.append(effect("s", 2, 2))
    h.bodies += [body("s", 1, 1, outcome="snoozed", start=1, end=1.1), body("s", 2, 2, start=2, end=2.1)]
    h.events += [claimed("s", 1, at=0.95), claimed("s", 2, at=1.9)]
    assert checks(h) == ["attempt"]
    h.jobs["s"]["attempt"] = 1
    h.bodies[-1]["attempt"] = 1
    h.effects[-1]["attempt"] = 1
    assert check(h) == []


def test_concurrency_exceeded_by_overlapping_bodies():
    h = clean()
    for name, start in (("l1", 1.0), ("l2", 1.5)):
        h.jobs[name] = job(name, kind="h_limited")
        h.effects.append(effect(name))
        h.bodies.append(body(name, start=start, end=start + 2, kind="h_limited", holder=f"{int(start * 10)}-x"))
        h.events.append(claimed(name, at=start - 0.05))
    assert checks(h) == ["concurrency"]
    h.bodies[-1]["started_at"] = T0 + 2.8  # begins 0.2 s before the other ends: grace
    assert check(h) == []


def test_a_killed_body_ends_at_its_kill():
    h = clean()
    for name, start, end, holder in (("l1", 1.0, None, "100-a"), ("l2", 3.2, 4.0, "200-z")):
        h.jobs[name] = job(name, kind="h_limited")
        h.effects.append(effect(name))
        h.bodies.append(body(name, start=start, end=end, kind="h_limited", holder=holder))
        h.events.append(claimed(name, at=start - 0.05))
    assert check(h) == []  # l1's process died at +3.0
    del h.pid_kills[100]
    assert checks(h) == ["concurrency"]


def test_a_timed_out_body_ends_at_its_timeout():
    h = clean()
    # l1's first attempt timed out at +1.5 and ran on (it never checks); its slot went to l2.
    h.jobs["l1"] = job("l1", kind="h_limited", attempt=2, generation=2)
    h.bodies.append(body("l1", start=1.0, end=3.0, kind="h_limited", holder="10-x"))
    h.bodies.append(body("l1", 2, 2, start=4.0, end=4.1, kind="h_limited", holder="40-x"))
    h.events += [claimed("l1", at=0.95), claimed("l1", 2, at=3.95)]
    h.effects.append(effect("l1", 2, 2))
    h.jobs["l2"] = job("l2", kind="h_limited")
    h.bodies.append(body("l2", start=2.0, end=2.9, kind="h_limited", holder="20-x"))
    h.events.append(claimed("l2", at=1.95))
    h.effects.append(effect("l2"))
    assert checks(h) == ["concurrency"]
    h.events.append({"job_id": "l1", "event": "retried", "attempt": 1, "detail": "timed out; in 0.1s", "at": T0 + 1.5})
    assert check(h) == []


def test_rate_exceeded_in_one_window():
    h = clean()
    for n in range(3):
        name = f"r{n}"
        h.jobs[name] = job(name, kind="h_rated")
        h.effects.append(effect(name))
        h.bodies.append(body(name, start=0.2 + n * 0.1, end=0.25 + n * 0.1, kind="h_rated"))
        h.events.append(claimed(name, at=0.1 + n * 0.1))
    assert checks(h) == ["rate"]
    h.events[-1]["at"] = T0 + 1.05
    h.bodies[-1].update(started_at=T0 + 1.1, ended_at=T0 + 1.2)
    assert check(h) == []


def test_errbacks_exactly_once():
    h = clean()
    h.jobs["f"] = job("f", status="failed", canvas={"link_error": [{"task": "h_errback"}]}, payload={"fail": True})
    h.bodies.append(body("f", start=1, end=1.2, outcome="failed"))
    h.events.append(claimed("f"))
    assert checks(h) == ["errback"]  # none fired
    for n in range(2):
        h.jobs[f"e{n}"] = job(f"e{n}", kind="h_errback", payload={"job_id": "f", "error": "asked"}, parent_id="f")
        h.effects.append(effect(f"e{n}"))
        h.bodies.append(body(f"e{n}", start=2 + n, end=2.5 + n))
    assert checks(h) == ["errback"]  # fired twice
    del h.jobs["e1"]
    h.effects.pop()
    h.bodies.pop()
    assert check(h) == []


def test_a_chord_body_only_after_its_whole_header():
    h = clean()
    h.ops.append(Op(T0, "chord", "body", {"header": ["a", "b"]}))
    assert checks(h) == ["errback"]  # header succeeded, no body
    h.jobs["body"] = job("body", kind="h_sum")
    h.effects.append(effect("body"))
    h.bodies.append(body("body", start=7, end=7.1))
    assert check(h) == []


def test_the_report_shows_the_seed_and_the_jobs_history():
    h = clean()
    h.effects.append(effect("a"))
    h.ops.append(Op(T0 + 1.5, "fault", None, {"fault": "lose_reply", "match": "COMMIT"}))
    violations = check(h)
    text = report(h, violations, seed=4242)
    assert "HISTORY_SEED=4242" in text and "[effect] a succeeded with 2 effects" in text
    shown = excerpt(h, violations[0])
    assert "body    start attempt=1 gen=1" in shown and "FAULT" in shown and "lose_reply" in shown


def test_a_snoozed_body_whose_process_died_before_the_snooze_was_written_spent_its_attempt():
    h = clean()
    h.jobs["s"] = job("s", kind="h_snooze", attempt=2, generation=2)
    h.effects.append(effect("s", 2, 2))
    # Its process (pid 100) was killed at +3.0, 0.2 s after the body snoozed.
    h.bodies += [body("s", 1, 1, outcome="snoozed", start=2.5, end=2.8), body("s", 2, 2, holder="200-b", start=5, end=5.1)]
    h.events += [claimed("s", 1, at=2.45), claimed("s", 2, at=4.9, owner="w2@testhost/200/boot")]
    assert check(h) == []
    h.pid_kills[100] = T0 + 4.5  # killed long after: the snooze's own write was lost
    h.node_kills = {}
    assert checks(h) == ["attempt"]


def test_a_snoozed_body_whose_lease_lapsed_in_a_postgresql_crash_spent_its_attempt():
    """The body snoozed, PostgreSQL crashed before the snooze was written, and the lease
    lapsed during the outage: the reaper ended the attempt (seeds 208641, 189805)."""
    h = clean()
    h.jobs["s"] = job("s", kind="h_snooze", attempt=2, generation=2)
    h.effects.append(effect("s", 2, 2))
    h.bodies += [body("s", 1, 1, outcome="snoozed", start=1.0, end=1.05), body("s", 2, 2, start=6, end=6.1)]
    h.events += [claimed("s", 1, at=0.95), claimed("s", 2, at=5.9)]
    h.events.append({"job_id": "s", "event": "reaped", "attempt": 1, "detail": "lease expired: pending", "at": T0 + 4.0})
    h.pid_kills, h.node_kills = {}, {}
    assert checks(h) == ["attempt"], "no crash: the snooze's own write was lost"
    h.ops.append(Op(T0 + 1.2, "fault", None, {"fault": "pg_crash"}))
    assert check(h) == []
    h.ops[-1] = Op(T0 + 4.5, "fault", None, {"fault": "pg_crash"})
    assert checks(h) == ["attempt"], "a crash after the reap excuses nothing"
