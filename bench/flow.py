"""``python -m bench flow``: what a limit costs at claim time (about 30 s).

1. Statements, timed from this process on a loopback connection to a throwaway
   PostgreSQL database, interleaved sample by sample so drift hits every variant alike:

   * ``claim_job`` as it was before flow control (the prepared claim + run-event CTE
     built on the unchanged ``claim_job``): the baseline;
   * the claim of an unlimited kind now (``claim.claim``: + pause guard + priority
     probe), through ``FlowControl.claim`` as a worker calls it;
   * the claim of a ``concurrency=64`` kind and of a ``rate_limit="100000/s"`` kind (one
     transaction under the kind's limits row lock; limits never reached);
   * the release of a limited job's slot (``FlowControl.release(rows)``: one transaction that
     locks the row, counts running jobs and wakes nobody).

   Each claimed job is completed (untimed) before the next sample.
2. End to end: one ``celery worker -c 2`` drains N no-op jobs of each kind (unlimited,
   concurrency=64, rate 100000/s), interleaved, repeated; jobs/s from the rows' own
   first claim and last completion.
3. Handover: two workers drain ``--handover`` (120) no-op jobs of a ``concurrency=1``
   kind, submitted at once: every job but the first waits for the previous one's
   release to wake it. Seconds from submit to the last completion, with the sweeper
   running every 5 s as beat would, and where they went (the submit, the first claim,
   each job's run, each handover from one success to the next claim). The handover is
   a chain of process wakeups (success commit, release, wake publish, the other
   worker's main process, its pool child, the claim), so it grows with the machine's
   load: about 5 ms each on an idle 2-core box, 30 ms at a load average of 13.
   ``python -m bench flow --only handover`` runs this part alone.

Output: ``bench/results/flow.{json,md}``.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import sqlalchemy as sa

from bench import harness
from bench.run import percentile
from bench.systems import CELERY_WORKER

OWNER = "bench@host/1/flow"
KINDS = ("noop", "noop_limited", "noop_rated")


def _claim_before_flow_control():
    """The worker's claim statement as it was before flow control: the claim of the
    delivered job (no pause guard, no priority swap) and its run event, as one CTE."""
    from celery_lease.db.statements import claim

    return claim.claim(swap=False)


def statements(leases, tasks, samples: int) -> dict:
    from celery_lease.db.prepared import Prepared
    from celery_lease.db.statements import attempt
    from celery_lease.lifecycle import transition as tr
    from celery_lease.lifecycle.claim import new_token
    from celery_lease.status import AttemptOutcome

    store, flow = leases.store, leases.flow
    before = Prepared(_claim_before_flow_control())
    specs = {kind: leases.registry.resolve(kind) for kind in KINDS}
    queues = {kind: iter(j.id for j in tasks[kind].submit_many([{}] * (samples + 5))) for kind in KINDS}
    queues["before"] = iter(j.id for j in tasks["noop"].submit_many([{}] * (samples + 5)))
    timings: dict[str, list[float]] = {k: [] for k in ("before", *KINDS, "release")}

    def complete(row) -> None:
        ending = tr.Ending(str(row["id"]), row["lease_generation"], AttemptOutcome.SUCCEEDED)
        store.guarded(attempt.end_jobs(store.dialect), tr.ending_params([ending]))

    for i in range(samples + 5):  # the first 5 warm connections and prepared statements
        for name in ("before", *KINDS):
            job_id = next(queues[name])
            started = time.perf_counter()
            if name == "before":
                params = {"job_id": job_id, "owner": OWNER, "wakeup_task": specs["noop"].task, "token": new_token()}
                row = store.execute_prepared(before, params)[0]
            else:
                row = flow.claim(job_id, specs[name], OWNER)
            elapsed = time.perf_counter() - started
            assert row is not None, f"{name}: claim refused"
            complete(row)
            if name in ("noop_limited", "noop_rated"):
                started = time.perf_counter()
                flow.release([row])
                if name == "noop_limited" and i >= 5:
                    timings["release"].append((time.perf_counter() - started) * 1e6)
            if i >= 5:
                timings[name].append(elapsed * 1e6)
    return {name: {"median_us": statistics.median(v), "p99_us": percentile(v, 99)} for name, v in timings.items()}


def drain(leases, tasks, kind: str, n: int, timeout: float = 120) -> float:
    """Submit n jobs of kind while the worker runs; jobs/s from first claim to last completion."""
    tasks[kind].submit_many([{}] * n)
    count = sa.text("SELECT count(*) FROM celery_lease_jobs WHERE kind = :k AND status = 'succeeded'")

    def done() -> bool:
        with leases.store.durable.connect() as conn:
            return conn.execute(count, {"k": kind}).scalar() >= n

    harness.wait_for(done, timeout=timeout, interval=0.1, what=f"{n} {kind} jobs")
    with leases.store.durable.begin() as conn:
        first, last = conn.execute(
            sa.text("SELECT min(started_at), max(finished_at) FROM celery_lease_jobs WHERE kind = :k"), {"k": kind}
        ).one()
        conn.execute(sa.text("DELETE FROM celery_lease_jobs WHERE kind = :k"), {"k": kind})
    return n / (last - first).total_seconds()


def handover(leases, tasks, n: int, timeout: float = 900) -> dict:
    """Seconds for n jobs of a concurrency=1 kind, submitted at once, to all succeed,
    and where they went: each job's run and each handover between two jobs.
    The sweeper runs every 5 s meanwhile, as beat would: a job flow control left
    pending without a wakeup is recovered after sweep_stale_seconds (30 s)."""
    import threading

    count = sa.text("SELECT count(*) FROM celery_lease_jobs WHERE kind = 'noop_one' AND status = 'succeeded'")
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(5.0):
            leases.sweep()

    sweeper = threading.Thread(target=beat, daemon=True)
    started = time.monotonic()
    tasks["noop_one"].submit_many([{}] * n)
    submitted = time.monotonic() - started
    sweeper.start()

    def done() -> bool:
        with leases.store.durable.connect() as conn:
            return conn.execute(count).scalar() >= n

    try:
        harness.wait_for(done, timeout=timeout, interval=0.05, what=f"{n} noop_one jobs")
    finally:
        stop.set()
        sweeper.join()
    elapsed = time.monotonic() - started
    with leases.store.durable.begin() as conn:
        spans = conn.execute(
            sa.text("SELECT started_at, finished_at FROM celery_lease_jobs WHERE kind = 'noop_one' ORDER BY started_at")
        ).all()
        created = conn.execute(sa.text("SELECT min(created_at) FROM celery_lease_jobs WHERE kind = 'noop_one'")).scalar()
        conn.execute(sa.text("DELETE FROM celery_lease_jobs WHERE kind = 'noop_one'"))
    runs = [(f - s).total_seconds() * 1e3 for s, f in spans]
    gaps = [(b[0] - a[1]).total_seconds() * 1e3 for a, b in zip(spans, spans[1:])]
    return {
        "seconds": elapsed,
        "submit_s": submitted,
        # claim -> success written (the body and the success transaction), and the
        # handover: one job's success written -> the next job's claim (release, wake,
        # delivery, claim), both in milliseconds by the database clock.
        # submit (the first row's insert) -> the first claim, and the last claim -> done
        "first_claim_s": (spans[0][0] - created).total_seconds(),
        "run_ms": {"median": statistics.median(runs), "p99": percentile(runs, 99)},
        "handover_ms": {"median": statistics.median(gaps), "p99": percentile(gaps, 99), "sum": sum(gaps)},
    }


def main(args, log) -> int:
    from bench.apps.lease import make_app

    dbs = harness.Databases()
    results: dict = {"samples": args.samples, "n": args.n, "reps": args.reps}
    with tempfile.TemporaryDirectory(prefix="celery-lease-bench-flow-") as tmp:
        out = Path(tmp)
        redis = harness.RedisServer(out)
        redis.start()
        worker = None
        try:
            url = dbs.create("flow")
            app, leases, tasks = make_app(url, redis.url)
            leases.create_schema()
            if args.only != "handover":
                results["statements"] = statements(leases, tasks, args.samples)
                log(f"statements: {results['statements']}")
                with leases.store.durable.begin() as conn:
                    conn.execute(sa.text("DELETE FROM celery_lease_jobs"))
            env = {
                **os.environ,
                "BENCH_BROKER": redis.url,
                "BENCH_OUT": str(out),
                "BENCH_DB": url,
                "PYTHONPATH": str(harness.ROOT),
            }
            worker = harness.WorkerProcess(
                [harness.celery(), "-A", "bench.apps.lease", *CELERY_WORKER, "-n", "flow@bench"], env, out
            )
            worker.start()
            if args.only != "handover":
                rates: dict[str, list[float]] = {k: [] for k in KINDS}
                for rep in range(args.reps):
                    for kind in KINDS:
                        rates[kind].append(drain(leases, tasks, kind, args.n))
                    log(f"rep {rep + 1}: " + ", ".join(f"{k} {v[-1]:.0f}/s" for k, v in rates.items()))
                results["drain_per_s"] = {k: statistics.median(v) for k, v in rates.items()}
                results["drain_all"] = rates
            (out / "second").mkdir()
            second = harness.WorkerProcess(
                [harness.celery(), "-A", "bench.apps.lease", *CELERY_WORKER, "-n", "flow2@bench"],
                {**env, "BENCH_OUT": str(out / "second")},
                out / "second",
            )
            second.start()
            try:
                results["handover"] = handover(leases, tasks, args.handover)
            finally:
                second.kill()
            log(f"handover: {args.handover} jobs of a concurrency=1 kind on 2 workers: {results['handover']}")
            leases.store.dispose()
        finally:
            if worker is not None:
                worker.kill()
            redis.stop()
            dbs.close()
    ho = results["handover"]
    handover_line = (
        f"handover: {args.handover} no-op jobs of a concurrency=1 kind, 2 workers -c 2: {ho['seconds']:.1f} s "
        f"(per job: run {ho['run_ms']['median']:.1f} ms, handover to the next {ho['handover_ms']['median']:.1f} ms "
        f"median, {ho['handover_ms']['p99']:.0f} ms p99, {ho['handover_ms']['sum'] / 1e3:.1f} s in all; "
        f"submit {ho['submit_s']:.2f} s, first claim {ho['first_claim_s']:.2f} s after it began)"
    )
    if args.only == "handover":
        print(handover_line)
        return 0
    st, dr = results["statements"], results["drain_per_s"]
    base = st["before"]["median_us"]
    lines = [
        "| claim path | median µs | p99 µs | vs. before flow control |",
        "|---|---|---|---|",
        *(
            f"| {label} | {st[k]['median_us']:.0f} | {st[k]['p99_us']:.0f} | "
            + ("(not a claim)" if k == "release" else f"{st[k]['median_us'] - base:+.0f} µs")
            + " |"
            for k, label in (
                ("before", "claim_job before flow control (baseline)"),
                ("noop", "unlimited kind (claim.claim)"),
                ("noop_limited", "concurrency=64"),
                ("noop_rated", 'rate_limit="100000/s"'),
                ("release", "release of a concurrency slot (after the outcome)"),
            )
        ),
        "",
        f"| drain, 1 worker -c 2, {args.n} no-op jobs, median of {args.reps} | jobs/s | vs. unlimited |",
        "|---|---|---|",
        *(f"| {k} | {dr[k]:.0f} | {dr[k] / dr['noop'] - 1:+.0%} |" for k in KINDS),
        "",
        handover_line,
    ]
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "flow.json").write_text(json.dumps(results, indent=2))
    (args.results / "flow.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0
