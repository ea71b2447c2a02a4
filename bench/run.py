"""The side-by-side run: every system, every body, interleaved repetitions.

One cell = one system, one body, one repetition, with the worker started once:

1. worker stopped: submit N jobs one call at a time (single submit rate), then N more
   in batches (batch submit rate); the database's transaction counter is read before,
   between and after, with every connection closed so the counters are exact;
2. start the worker: it drains the 2N backlog. Drain throughput = 2N / (last end -
   first start) over the completed jobs' own timestamps, so worker start-up is not
   counted. CPU per job by process, and the database's WAL, fsyncs and HOT updates
   (bench/cpu.py), over the drain: Celery-based workers
   start held and are released once warm, the others are measured from their ready
   marker, so start-up is not counted there either;
3. worker warm and idle: submit N jobs one at a time from the bench while it runs.
   End-to-end throughput = N / (last end - first submit); claim-to-complete latency
   p50/p99 over these N;
4. stop the worker (warm shutdown); peak RSS of main process plus children over its life.

Statements per job: celery-lease counts its own with a SQLAlchemy listener (producer in
this process, workers in theirs). For every PostgreSQL system, transactions per job come
from pg_stat_database (xact_commit + xact_rollback) deltas; procrastinate and pgqueuer
run each statement in autocommit, so for them a transaction is a statement. The
worker's figure is the delta over its life minus the end-to-end phase's producer
transactions (N times the measured single-submit figure) and the bench's own polls,
divided by the 3N jobs it ran.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import harness
from bench.apps import BODIES, SLEEP_SECONDS, counting
from bench.cpu import CpuMeter, PgMeter, per_job_us
from bench.systems import Lease, System


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))
    return ordered[k]


def dump_stacks(pids: list[int]) -> str:
    """py-spy dumps of the given processes (all threads), for a cell that timed out."""
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    out = []
    for pid in pids:
        try:
            done = subprocess.run([pyspy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30)
            out.append(done.stdout or done.stderr)
        except (OSError, subprocess.SubprocessError) as exc:
            out.append(f"{pid}: no dump ({exc!r})")
    return "\n".join(out)


#: No job finished for this long while some are missing: ask the system to rescue them
#: (celery-lease: reap, as beat would; its bench jobs hold 5 s leases).
STALL_SECONDS = 7.0


def wait_completed(system: System, out: Path, target: int, timeout: float, log, what: str) -> int:
    """Wait until ``target`` jobs completed; returns how many the system had to rescue.

    A job its worker left running (claimed, never completed) would stall the cell until
    the timeout: when nothing completes for STALL_SECONDS, the system rescues what it
    can (celery-lease reaps expired leases, requeuing those jobs) and the count is
    reported with the cell, whose figures then include the stall.
    """
    deadline = time.monotonic() + timeout
    last, last_change, rescued = -1, time.monotonic(), 0
    while True:
        done = system.completed(out)
        if done >= target:
            return rescued
        now = time.monotonic()
        if done != last:
            last, last_change = done, now
        elif now - last_change > STALL_SECONDS:
            n = system.rescue()
            if n:
                rescued += n
                log(f"{system.name}: {target - done} {what} stalled; {n} rescued (left running by their worker)")
            last_change = now
        if now > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {system.name} to complete {target} {what}")
        time.sleep(0.1)


class Cell:
    def __init__(self, system: System, body: str, n: int, rep: int, out: Path, broker, dbs, chunk: int, log) -> None:
        self.system, self.body, self.n, self.rep = system, body, n, rep
        self.out, self.broker, self.dbs, self.chunk, self.log = out, broker, dbs, chunk, log
        #: Jobs the system had to rescue (left running by a worker) during this cell.
        self.rescued = 0

    def _xacts(self) -> int | None:
        s = self.system
        if s.db is None:
            return None
        s.close()
        self.dbs.quiesce(s.db)
        return self.dbs.transactions(s.db)

    def _wait_completed(self, target: int) -> None:
        timeout = 120 + target * (0.01 + 5 * SLEEP_SECONDS[self.body])
        self.rescued += wait_completed(self.system, self.out, target, timeout, self.log, f"{self.body} jobs")

    def _submit(self, batch: bool) -> tuple[float, dict]:
        before = dict(counting.STATEMENTS)
        started = time.perf_counter()
        if batch:
            self.system.submit_batch(self.body, self.n, self.chunk)
        else:
            for _ in range(self.n):
                self.system.submit_one(self.body)
        elapsed = time.perf_counter() - started
        delta = {k: v - before.get(k, 0) for k, v in counting.STATEMENTS.items() if v != before.get(k, 0)}
        return self.n / elapsed, delta

    def run(self) -> dict:
        s, n = self.system, self.n
        self.out.mkdir(parents=True, exist_ok=True)
        s.reset(self.out)
        self.broker.flush()
        r: dict = {"system": s.name, "body": self.body, "n": n, "rep": self.rep}

        x0 = self._xacts()
        r["submit_rate"], single_stmts = self._submit(batch=False)
        x1 = self._xacts()
        r["submit_many_rate"], batch_stmts = self._submit(batch=True)
        x2 = self._xacts()
        polls0 = s.polls

        worker = harness.WorkerProcess(s.worker_args(hold=s.holdable), s.env(self.broker.url, self.out), self.out)
        pg = PgMeter.of(s)  # before the worker starts: procrastinate and pgqueuer drain at once
        if pg is not None:
            pg.start()
        try:
            worker.start()
            meter = CpuMeter(worker, s, self.broker.proc.pid, pg)
            meter.start()
            if s.holdable:
                s.release()
            self._wait_completed(2 * n)
            r["cpu_us"] = per_job_us(meter.stop(), 2 * n)
            drained = s.records(self.out)
            first_start = min(start for start, _ in drained)
            last_end = max(end for _, end in drained)
            r["drain_rate"] = len(drained) / (last_end - first_start)
            r.update(meter.pg_per_job(2 * n))  # WAL, fsyncs, HOT updates over the drain

            time.sleep(0.3)  # idle and warm: every drain job is finished and recorded
            boundary = time.time()
            for _ in range(n):
                s.submit_one(self.body)
            self._wait_completed(3 * n)
            e2e = [(a, b) for a, b in s.records(self.out) if a >= boundary]
            r["e2e_rate"] = len(e2e) / (max(b for _, b in e2e) - boundary)
            latencies = [(b - a) * 1000 for a, b in e2e]
            r["latency_p50_ms"] = percentile(latencies, 50)
            r["latency_p99_ms"] = percentile(latencies, 99)
        except Exception:
            # BENCH_DUMP_STACKS=1: where every worker process is, before it is stopped.
            if os.environ.get("BENCH_DUMP_STACKS") and worker.proc is not None:
                self.log(dump_stacks([worker.proc.pid, *worker.children()]))
            raise
        finally:
            worker.stop()
        r["peak_rss_mb"] = worker.peak_rss / 2**20
        r["peak_pss_mb"] = worker.peak_pss / 2**20
        r["rescued"] = self.rescued
        polls = s.polls - polls0
        x3 = self._xacts()

        if isinstance(s, Lease):
            r["producer_statements_per_job"] = sum(single_stmts.values()) / n
            r["producer_statements_per_job_batch"] = sum(batch_stmts.values()) / n
            ran = s.worker_statements(self.out)
            r["worker_statements_per_job"] = sum(ran.values()) / (3 * n)
            r["worker_statements"] = {k: round(v / (3 * n), 3) for k, v in sorted(ran.items())}
            r["producer_statements"] = {k: round(v / n, 3) for k, v in sorted(single_stmts.items())}
        if x0 is not None:
            single_x = (x1 - x0) / n
            r["producer_xacts_per_job"] = single_x
            r["producer_xacts_per_job_batch"] = (x2 - x1) / n
            r["worker_xacts_per_job"] = (x3 - x2 - polls - single_x * n) / (3 * n)
        elif s.name == "celery":
            r["producer_statements_per_job"] = r["worker_statements_per_job"] = 0.0
        return r


METRICS = ("submit_rate", "submit_many_rate", "e2e_rate", "drain_rate", "latency_p50_ms", "latency_p99_ms", "peak_rss_mb")


def add_ratios(cells: list[dict]) -> None:
    """Each figure's ratio to (or difference from) plain Celery's in the same repetition
    and body: medians of these, not ratios of medians, are what the report shows."""
    base = {(c["rep"], c["body"]): c for c in cells if c["system"] == "celery"}
    for c in cells:
        ref = base.get((c["rep"], c["body"]))
        if ref is None:
            continue
        c["ratio"] = {m: c[m] / ref[m] for m in METRICS if c.get(m) and ref.get(m)}
        c["rss_delta_mb"] = c["peak_rss_mb"] - ref["peak_rss_mb"]
        if c.get("peak_pss_mb") and ref.get("peak_pss_mb"):
            c["pss_delta_mb"] = c["peak_pss_mb"] - ref["peak_pss_mb"]
        if "cpu_us" in c and "cpu_us" in ref:
            c["cpu_delta_us"] = c["cpu_us"]["total"] - ref["cpu_us"]["total"]


def summarize(cells: list[dict]) -> list[dict]:
    """Median over repetitions of every figure and ratio, per system and body."""
    rows = []
    keys = sorted(
        {(c["system"], c["body"]) for c in cells}, key=lambda k: (BODIES.index(k[1]), [c["system"] for c in cells].index(k[0]))
    )
    for system, body in keys:
        group = [c for c in cells if c["system"] == system and c["body"] == body]
        row: dict = {"system": system, "body": body, "n": group[0]["n"], "reps": len(group)}
        for key in group[0]:
            values = [c[key] for c in group if isinstance(c.get(key), (int, float))]
            if key not in ("rep", "n") and values and len(values) == len(group):
                row[key] = statistics.median(values)
                row[f"{key}_range"] = [min(values), max(values)]
        if "ratio" in group[0]:
            row["ratio"] = {m: statistics.median(c["ratio"][m] for c in group if m in c["ratio"]) for m in group[0]["ratio"]}
        if all("cpu_us" in c for c in group):
            row["cpu_us"] = {k: statistics.median(c["cpu_us"][k] for c in group) for k in group[0]["cpu_us"]}
        for key in ("worker_statements", "producer_statements"):
            if key in group[0]:
                row[key] = group[-1][key]
        rows.append(row)
    return rows


def run(systems: list[System], *, sizes: dict[str, int], reps: int, chunk: int, workdir: Path, broker, dbs, log) -> list[dict]:
    """``sizes``: N per body (bodies with N = 0 are skipped)."""
    cells = []
    for rep in range(1, reps + 1):
        for body in BODIES:
            n = sizes.get(body, 0)
            if n <= 0:
                continue
            for system in systems:
                out = workdir / f"{system.name}-{body}-{rep}"
                started = time.monotonic()
                try:
                    cell = Cell(system, body, n, rep, out, broker, dbs, chunk, log).run()
                except Exception:
                    try:
                        log(f"{system.name} {body} rep {rep}: {system.diagnose()}")
                    except Exception as exc:  # the diagnosis must not hide the failure
                        log(f"no diagnosis: {exc!r}")
                    log_path = out / "worker.log"
                    if log_path.exists():
                        log(f"{system.name} {body} rep {rep} failed; its worker's log ends:\n{log_path.read_text()[-4000:]}")
                    raise
                cells.append(cell)
                log(
                    f"rep {rep} {body:7} {system.name:13} e2e {cell['e2e_rate']:7.0f}/s  "
                    f"drain {cell['drain_rate']:7.0f}/s  submit {cell['submit_rate']:6.0f}/s  "
                    f"batch {cell['submit_many_rate']:7.0f}/s  p50 {cell['latency_p50_ms']:.2f} ms  "
                    f"rss {cell['peak_rss_mb']:.0f} MB  cpu {cell['cpu_us']['total']:,.0f} µs/job  "
                    f"({time.monotonic() - started:.0f}s)"
                )
    add_ratios(cells)
    return cells
