"""The history checker: what the product promised, checked against what happened.

A run (tests/harness/history_run.py) records every operation the test made (submits,
cancels, revokes, faults) and reads back every effect: the job rows and their run
events from the jobs' database, the bodies and fenced writes the handlers recorded
(tests/apps/app_history.py), the effects committed with successes. :func:`check` takes
that :class:`History` and returns the violations; :func:`excerpt` prints the part of
the history that shows one of them. Plain data in, plain data out: tests/unit tests
the checker on hand-made histories, so each check is seen to fire.

What is checked (the lease promise, issue #18):

* **lost**: every job a submit returned exists;
* **terminal**: every job ended (none pending or running after the drain);
* **outcome**: a job that nobody cancelled and that was not asked to fail succeeded
  (the kinds have attempts to spare), a job whose cancel returned True is cancelled;
* **effect**: a succeeded job has exactly one effect, of its final attempt and
  generation; any other job has none;
* **fencing**: no two holders (processes) ran a body, or had a fenced write accepted,
  under one generation of one job; a job's generations only grow;
* **attempt without body**: every attempt a job spent had a body that ran and did not
  snooze (a snooze spends nothing), unless the process it was claimed by was killed
  right after the claim (a claim event names its owner) or the job was cancelled;
* **concurrency**: bodies of a ``concurrency=N`` kind never overlap more than N deep
  (a body killed with its process ends at the kill; one whose attempt timed out, at its
  timeout: the slot is freed then, and a handler that never checks its stop point runs
  on, as docs/guide.md says under "Timeout");
* **rate**: claims of a rated kind per window (the database clock, epoch-aligned as
  the product counts them) never exceed the rate;
* **errback**: a job with a leased errback that did not succeed has exactly one errback
  job, one that succeeded has none; a chord's body exists once if its whole header
  succeeded and never otherwise;
* **worker**: no worker ended that no fault killed (a restart would hide it: the run
  looks before each kill and at the end).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from celery_lease.lifecycle.owner import owner_pid
from celery_lease.worker.outcome import TIMED_OUT

TERMINAL = ("succeeded", "failed", "expired", "cancelled")
#: Overlaps of limited bodies shorter than this are not counted: a body notices a lost
#: lease at its next stop point (every step, at most 0.3 s apart in these handlers).
OVERLAP_GRACE = 0.5


@dataclass
class Op:
    at: float  # time.time() in the test process (the same host as the workers)
    op: str  # submit, cancel, revoke, chord, fault
    job_id: str | None = None
    detail: dict = field(default_factory=dict)


@dataclass
class History:
    ops: list[Op]
    #: job rows: id, kind, status, attempt, lease_generation, error, parent_id, canvas,
    #: payload, created_at, finished_at (epoch floats)
    jobs: dict[str, dict]
    #: run events: job_id, event, attempt, detail, at (database clock, epoch float)
    events: list[dict]
    #: history_bodies rows (tests/apps/app_history.py)
    bodies: list[dict]
    #: history_writes rows
    writes: list[dict]
    #: history_effects rows (the jobs' database)
    effects: list[dict]
    #: kind -> concurrency (limited kinds)
    concurrency: dict[str, int]
    #: kind -> (rate, per_seconds)
    rates: dict[str, tuple[int, int]]
    #: kinds whose bodies write an effect with their success
    effect_kinds: frozenset[str]
    #: node (e.g. "w1@testhost") -> kill times; pid -> kill time (every process a
    #: worker kill took down, its pool children included)
    node_kills: dict[str, list[float]] = field(default_factory=dict)
    pid_kills: dict[int, float] = field(default_factory=dict)
    #: nodes found ended that no fault had killed
    ended_workers: list[str] = field(default_factory=list)


class HistoryViolated(AssertionError):
    """The checker found violations (the test's failure; anything else that fails a
    history run is a fault of the harness, not a finding)."""


@dataclass
class Violation:
    check: str
    job_id: str | None
    message: str

    def __str__(self) -> str:
        return f"[{self.check}] {self.job_id or ''} {self.message}"


def check(h: History) -> list[Violation]:
    out: list[Violation] = []
    for fn in (_lost_and_terminal, _outcomes, _effects, _fencing, _attempts, _concurrency, _rates, _errbacks, _workers):
        out.extend(fn(h))
    return out


# --- the checks ---------------------------------------------------------------------------


def _workers(h: History) -> list[Violation]:
    return [Violation("worker", None, f"worker {node} ended on its own") for node in h.ended_workers]


def _submitted(h: History) -> dict[str, Op]:
    return {op.job_id: op for op in h.ops if op.op == "submit" and op.job_id}


def _lost_and_terminal(h: History) -> list[Violation]:
    out = []
    for job_id in _submitted(h):
        if job_id not in h.jobs:
            out.append(Violation("lost", job_id, "submitted (the submit returned it) but no row exists"))
    for job_id, job in h.jobs.items():
        if job["status"] not in TERMINAL:
            out.append(Violation("terminal", job_id, f"still {job['status']} after the drain"))
    return out


def _cancel_attempts(h: History) -> dict[str, list[Op]]:
    by_job: dict[str, list[Op]] = defaultdict(list)
    for op in h.ops:
        if op.op in ("cancel", "revoke") and op.job_id:
            by_job[op.job_id].append(op)
    return by_job


def _outcomes(h: History) -> list[Violation]:
    out = []
    cancels = _cancel_attempts(h)
    for job_id, job in h.jobs.items():
        if job["status"] not in TERMINAL:
            continue  # reported as not terminal
        tried = cancels.get(job_id, [])
        if any(op.op == "cancel" and op.detail.get("returned") for op in tried):
            if job["status"] != "cancelled":
                out.append(Violation("outcome", job_id, f"cancel returned True but the job ended {job['status']}"))
            continue
        if tried or _chained_from_cancelled(h, job):
            continue  # a revoke or a cancel that raced: any terminal status is honest
        wanted = "failed" if _asked_to_fail(job) else "succeeded"
        if job["status"] != wanted and not (wanted == "failed" and job["status"] == "cancelled"):
            out.append(Violation("outcome", job_id, f"ended {job['status']} (error {job.get('error')!r}), expected {wanted}"))
    return out


def _asked_to_fail(job: dict) -> bool:
    payload = job.get("payload")
    return isinstance(payload, dict) and bool(payload.get("fail"))


def _chained_from_cancelled(h: History, job: dict) -> bool:
    """A job whose parent was cancelled, or an errback or a chord body (their fate
    follows another job's): only the general checks apply."""
    return job.get("parent_id") is not None and job["kind"] in ("h_errback", "h_sum")


def _effects(h: History) -> list[Violation]:
    out = []
    per_job: dict[str, list[dict]] = defaultdict(list)
    for e in h.effects:
        per_job[e["job_id"]].append(e)
    for job_id, job in h.jobs.items():
        mine = per_job.get(job_id, [])
        if job["status"] == "succeeded" and job["kind"] in h.effect_kinds:
            if len(mine) != 1:
                out.append(Violation("effect", job_id, f"succeeded with {len(mine)} effects (expected exactly 1)"))
            elif (mine[0]["attempt"], mine[0]["generation"]) != (job["attempt"], job["lease_generation"]):
                e = mine[0]
                out.append(
                    Violation(
                        "effect",
                        job_id,
                        f"effect of attempt {e['attempt']} generation {e['generation']}, but the success is attempt "
                        f"{job['attempt']} generation {job['lease_generation']}",
                    )
                )
        elif job["status"] != "succeeded" and mine:
            out.append(Violation("effect", job_id, f"ended {job['status']} but {len(mine)} effect(s) committed"))
    for job_id in per_job.keys() - h.jobs.keys():
        out.append(Violation("effect", job_id, "effect of a job that does not exist"))
    return out


def _fencing(h: History) -> list[Violation]:
    out = []
    for rows, what in ((h.bodies, "ran a body"), (h.writes, "had a fenced write accepted")):
        holders: dict[tuple[str, int], set[str]] = defaultdict(set)
        for r in rows:
            holders[(r["job_id"], r["generation"])].add(r["holder"])
        for (job_id, generation), who in sorted(holders.items()):
            if len(who) > 1:
                out.append(
                    Violation("fencing", job_id, f"{len(who)} holders {what} under generation {generation}: {sorted(who)}")
                )
    per_job: dict[str, list[dict]] = defaultdict(list)
    for b in h.bodies:
        per_job[b["job_id"]].append(b)
    for job_id, bs in per_job.items():
        bs.sort(key=lambda b: b["started_at"])
        for before, after in zip(bs, bs[1:]):
            if after["generation"] < before["generation"]:
                out.append(
                    Violation("fencing", job_id, f"generation went back from {before['generation']} to {after['generation']}")
                )
    return out


#: A body starts within milliseconds of its claim: a kill of the claiming process this
#: soon after the claim excuses a claim without a body.
KILL_EXCUSE = 1.5
#: A fault's op is recorded as the harness starts it, before it acts: ``pg_ctl stop -m
#: immediate`` takes tens of milliseconds to end the backends, and a claim that began in
#: between can still commit before the server dies, its reply lost with it (history[threads]
#: seed 801828: the claim's transaction began 47 ms after the pg_crash op). An outage
#: recorded up to this long before a claim still counts as beginning after it.
FAULT_LAG = 0.5


def _killed(h: History, owner: str | None, at: float, reaped_at: float | None = None) -> bool:
    """Whether the process named by a claim's owner ("node/pid/boot", or a thread's
    "node/pid.T/boot") was killed before or right after the claim at ``at`` (or its
    node right after), or at any time before the reaper took that attempt back
    (``reaped_at``): a process that dies holding a claim spends its attempt, however
    long it held it before its body would have started. (history[prepared] seed
    674547: a rate-limited claim's follow-up, the wake of the jobs held for the new
    window, was held by the proxy; the child, its body not yet started, was killed
    1.57 s after the claim and the reaper spent the attempt.)"""
    if not owner:
        return False
    node = owner.partition("/")[0]
    window = (at - 0.5, max(at + KILL_EXCUSE, reaped_at or 0.0))
    if any(window[0] <= t <= window[1] for t in h.node_kills.get(node, [])):
        return True
    # Killed before the claim landed counts too: a claim delayed in flight (the proxy's
    # delay or hold) can commit after the process that sent it died. (A thread's owner
    # names its process before the dot: read with the product's own owner_pid, else a
    # threads pool's in-flight claims were never excused: history[threads] seed 150679.)
    pid = owner_pid(owner)
    killed = h.pid_kills.get(pid) if pid is not None else None
    return killed is not None and killed <= window[1]


def _attempts(h: History) -> list[Violation]:
    out = []
    ran: dict[str, set[int]] = defaultdict(set)
    # A backend SIGKILLed (kill_backend) is a crash too: the postmaster resets every
    # backend and replays the WAL, and a claim it cut off may have landed while its
    # worker, refused during the recovery, gave the delivery up (history[prepared] seed
    # 639886: a chord body's claim, then "the database system is in recovery mode").
    crashes = [op.at for op in h.ops if op.op == "fault" and op.detail.get("fault") in ("pg_crash", "pg_restart", "kill_backend")]
    reaped = {(e["job_id"], e["attempt"]): e["at"] for e in h.events if e["event"] == "reaped"}
    for b in h.bodies:
        # A snoozed body spends nothing, unless its process died before the snooze
        # was written, or PostgreSQL crashed between the body's start and the reap of
        # its attempt: the snooze could not land within the lease, and the reaper
        # ended the attempt (an outage longer than a lease loses the lease).
        killed = h.pid_kills.get(b["pid"])
        died = killed is not None and b.get("ended_at") is not None and 0 <= killed - b["ended_at"] <= KILL_EXCUSE
        reaped_at = reaped.get((b["job_id"], b["attempt"]))
        lapsed = reaped_at is not None and any(b["started_at"] <= t <= reaped_at for t in crashes)
        if b.get("outcome") != "snoozed" or died or lapsed:
            ran[b["job_id"]].add(b["attempt"])
    # A partition longer than the lease (the proxy pauses right after a lost COMMIT
    # reply) that begins just after a claim: the claiming worker cannot learn that it
    # holds the job before the lease has run out, so the reaper spends that attempt
    # (history[prepared] seed 25805: the lost reply was the claim's own COMMIT).
    # Likewise a PostgreSQL crash just after a claim: a claim whose reply came too late
    # in its lease is handed off, not started, and the hand-off cannot land while the
    # server recovers for longer than the lease, so the reaper spends the attempt
    # (history[prepared] seed 987532: "claimed too late in its lease; handed back",
    # then "database unavailable" until the lease was lost).
    partitions = [op.at for op in h.ops if op.op == "fault" and op.detail.get("fault") == "partition"]
    outages = sorted(partitions + crashes)
    excused: dict[str, set[int]] = defaultdict(set)
    claimed: dict[str, list[dict]] = defaultdict(list)
    for e in h.events:
        if e["event"] == "claimed":
            claimed[e["job_id"]].append(e)
            cut_off = any(-FAULT_LAG <= t - e["at"] <= KILL_EXCUSE for t in outages)
            if cut_off or _killed(h, e.get("detail"), e["at"], reaped.get((e["job_id"], e["attempt"]))):
                excused[e["job_id"]].add(e["attempt"])
    # Without claim events, a job's attempt may have been cut off by any of them.
    any_kill = sorted([t for ts in h.node_kills.values() for t in ts] + list(h.pid_kills.values()) + outages)
    for job_id, job in h.jobs.items():
        missing = [a for a in range(1, job["attempt"] + 1) if a not in ran[job_id] and a not in excused[job_id]]
        if job["status"] == "cancelled" and missing and missing[-1] == job["attempt"]:
            missing.pop()  # cancelled between its claim and its body: nothing to run
        if missing and not claimed.get(job_id):
            # No claim events (a canvas step or a batched job outside any run): excuse
            # as many as processes were killed, partitions began or PostgreSQL crashed
            # during its life (history[unprepared] seed 218077: a batched claim's reply
            # cut off by a partition longer than the lease).
            life = [t for t in any_kill if job["created_at"] - 1 <= t <= (job.get("finished_at") or float("inf"))]
            missing = missing[len(life) :]
        if missing:
            out.append(Violation("attempt", job_id, f"attempt(s) {missing} spent without a body that ran (and did not snooze)"))
    return out


def _body_end(h: History, b: dict, horizon: float) -> float:
    """When a body stopped: its recorded end, else the kill of its process."""
    if b.get("ended_at") is not None:
        return b["ended_at"]
    killed = h.pid_kills.get(b["pid"])
    return killed if killed is not None and killed >= b["started_at"] else horizon


def _concurrency(h: History) -> list[Violation]:
    out = []
    horizon = max([b["started_at"] for b in h.bodies], default=0.0) + 3600
    timed_out = {
        (e["job_id"], e["attempt"]): e["at"]
        for e in h.events
        if e["event"] in ("retried", "failed") and (e["detail"] or "").startswith(TIMED_OUT)
    }
    for kind, limit in h.concurrency.items():
        spans = [
            (b["started_at"], min(_body_end(h, b, horizon), timed_out.get((b["job_id"], b["attempt"]), horizon)), b)
            for b in h.bodies
            if b["kind"] == kind
        ]
        for start, _, b in spans:
            # Bodies running at this body's start, each for longer than the grace.
            live = [o for s, e, o in spans if s <= start and e - start > OVERLAP_GRACE]
            if len(live) > limit:
                who = ", ".join(f"{o['job_id'][:8]}#{o['attempt']}" for o in live)
                out.append(
                    Violation("concurrency", b["job_id"], f"{len(live)} bodies of {kind} (limit {limit}) ran at once: {who}")
                )
    return out


def _rates(h: History) -> list[Violation]:
    out = []
    for kind, (rate, per) in h.rates.items():
        windows: dict[int, list[dict]] = defaultdict(list)
        for e in h.events:
            if e["event"] == "claimed" and h.jobs.get(e["job_id"], {}).get("kind") == kind:
                windows[int(e["at"] // per)].append(e)
        for window, claims in sorted(windows.items()):
            if len(claims) > rate:
                out.append(
                    Violation(
                        "rate", claims[-1]["job_id"], f"{len(claims)} claims of {kind} in window {window} (rate {rate}/{per}s)"
                    )
                )
    return out


def _errbacks(h: History) -> list[Violation]:
    out = []
    errbacks: dict[str, list[str]] = defaultdict(list)
    for job_id, job in h.jobs.items():
        if job["kind"] == "h_errback" and isinstance(job.get("payload"), dict):
            errbacks[job["payload"].get("job_id")].append(job_id)
    for job_id, job in h.jobs.items():
        canvas = job.get("canvas") or {}
        if not canvas.get("link_error") or job["status"] not in TERMINAL:
            continue
        n = len(errbacks.get(job_id, []))
        if job["status"] == "succeeded" and n:
            out.append(Violation("errback", job_id, f"succeeded but {n} errback job(s) were created"))
        elif job["status"] != "succeeded" and n != 1:
            out.append(Violation("errback", job_id, f"ended {job['status']} with {n} errback jobs (expected exactly 1)"))
    for op in h.ops:
        if op.op != "chord":
            continue
        header, body = op.detail["header"], op.job_id
        statuses = [h.jobs.get(j, {}).get("status") for j in header]
        if any(s not in TERMINAL for s in statuses):
            continue
        exists = body in h.jobs
        if all(s == "succeeded" for s in statuses) != exists:
            out.append(Violation("errback", body, f"chord body exists={exists} with its header ended {statuses}"))
        fired = sum(len(errbacks.get(j, [])) for j in header)
        if not exists and fired != 1:
            out.append(Violation("errback", body, f"chord failed ({statuses}) and its body's errback fired {fired} times"))
    return out


# --- showing a violation ------------------------------------------------------------------


def _related(h: History, job_id: str) -> list[str]:
    """The job, and for a chord's body its header; with each, its errback jobs."""
    ids = [job_id]
    for op in h.ops:
        if op.op == "chord" and op.job_id == job_id:
            ids += op.detail["header"]
    for other, job in h.jobs.items():
        payload = job.get("payload")
        if job["kind"] == "h_errback" and isinstance(payload, dict) and payload.get("job_id") in ids:
            ids.append(other)
    return ids


def excerpt(h: History, v: Violation, *, limit: int = 60) -> str:
    """The history of the violation's job (a chord's body: with its header; with its
    errback jobs) and the faults around it, in time order."""
    if v.job_id is None:
        return str(v)
    ids = _related(h, v.job_id)
    tag = {j: "" if len(ids) == 1 else f"{j[:8]} " for j in ids}
    lines: list[tuple[float, str]] = []
    for op in h.ops:
        if op.job_id in tag:
            lines.append((op.at, f"{tag[op.job_id]}op      {op.op} {op.detail}"))
    for e in h.events:
        if e["job_id"] in tag:
            lines.append((e["at"], f"{tag[e['job_id']]}event   {e['event']} attempt={e['attempt']} {e.get('detail') or ''}"))
    for b in h.bodies:
        if b["job_id"] in tag:
            t = tag[b["job_id"]]
            lines.append((b["started_at"], f"{t}body    start attempt={b['attempt']} gen={b['generation']} holder={b['holder']}"))
            if b.get("ended_at") is not None:
                lines.append((b["ended_at"], f"{t}body    end   attempt={b['attempt']} gen={b['generation']} {b.get('outcome')}"))
    for w in h.writes:
        if w["job_id"] in tag:
            lines.append((w["at"], f"{tag[w['job_id']]}write   step={w['step']} gen={w['generation']} holder={w['holder']}"))
    if lines:
        first, last = min(t for t, _ in lines) - 1.0, max(t for t, _ in lines) + 1.0
        for op in h.ops:
            if op.op == "fault" and first <= op.at <= last:
                lines.append((op.at, f"FAULT   {op.detail}"))
    lines.sort(key=lambda x: x[0])
    t0 = lines[0][0] if lines else 0.0
    out = [str(v)]
    for j in ids:
        job = h.jobs.get(j)
        shown = job and {k: job.get(k) for k in ("kind", "status", "attempt", "lease_generation", "error")}
        effects = [(e["attempt"], e["generation"]) for e in h.effects if e["job_id"] == j]
        out.append(f"  {tag[j]}job: {shown} effects (attempt, generation): {effects}")
    out += [f"  +{t - t0:7.3f}s {text}" for t, text in lines[:limit]]
    return "\n".join(out)


def report(h: History, violations: list[Violation], *, seed: int, per_check: int = 3) -> str:
    """Every violation as one line, and a few excerpts of each kind."""
    shown: dict[str, int] = defaultdict(int)
    parts = [f"{len(violations)} violation(s); replay with HISTORY_SEED={seed}"]
    parts += [str(v) for v in violations[:50]]
    for v in violations:
        if shown[v.check] < per_check:
            shown[v.check] += 1
            parts.append(excerpt(h, v))
    return "\n".join(parts)


def summary(h: History) -> dict[str, Any]:
    statuses: dict[str, int] = defaultdict(int)
    for job in h.jobs.values():
        statuses[job["status"]] += 1
    faults: dict[str, int] = defaultdict(int)
    armed = 0
    for op in h.ops:
        if op.op == "fault":
            faults[op.detail.get("fault", "?")] += 1
        armed += op.op == "armed"
    return {"jobs": len(h.jobs), "statuses": dict(statuses), "faults": dict(faults), "armed": armed, "bodies": len(h.bodies)}
