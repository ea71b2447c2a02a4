"""``python -m bench scale``: does the size of the jobs table slow maintenance or claims?

On a throwaway PostgreSQL database and a private Redis (wakeups are really published):

1. **idle ticks and claim** — ``leases.reap()`` and ``leases.sweep()`` with nothing to do
   (one autocommit statement each) and the claim statement (``claim_delivery`` of
   a fresh pending job), on an empty table and then with ``--rows`` terminal rows
   (succeeded/failed/cancelled/expired, one ``generate_series`` INSERT, then
   ``VACUUM ANALYZE``). Median and p99 of ``--samples`` calls each.
2. **reaping** — ``--expired`` running jobs whose lease elapsed a minute ago (attempt 1
   of 3, so each is requeued and its wakeup published, the common case after a worker
   died), beside the terminal rows; ``leases.reap()`` is called until it finds nothing.
   Rows per second = rows / time spent in those calls (beat would spread the calls over
   several ticks; this is the work each tick does).
3. **sweeping a fresh backlog** — pending jobs whose wakeup was just published (so the
   sweeper has nothing to send), at each size of ``--backlog`` in turn; the median
   ``leases.sweep()`` of ``--sweep-samples`` calls at each size. The app runs with
   ``sweep_stale_seconds`` of a day so the backlog stays fresh however long the fill
   takes; the figure records how many wakeups each tick sent (0 expected).

Timings are wall time from this process over loopback, round trip included. The fills
are bench set-up, not product SQL: the fastest way to a large table.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import sqlalchemy as sa

from bench import harness
from bench.apps.lease import make_app
from bench.run import percentile
from celery_lease.lifecycle.claim import claim_delivery

_COLUMNS = """(id, kind, task, status, attempt, max_attempts, lease_seconds, lease_generation, lease_losses,
    lease_owner, lease_expires_at, woken_at, payload, result, created_at, updated_at, started_at, finished_at)"""

FILL_TERMINAL = f"""
INSERT INTO celery_lease_jobs {_COLUMNS}
SELECT gen_random_uuid(), 'noop', 'bench.lease.noop',
    (ARRAY['succeeded', 'failed', 'cancelled', 'expired'])[1 + i % 4], 1, 3, 60, 1, 0,
    NULL, NULL, now() - make_interval(secs => i), '{{}}'::jsonb, '{{"ok": true}}'::jsonb,
    now() - make_interval(secs => i), now() - make_interval(secs => i),
    now() - make_interval(secs => i), now() - make_interval(secs => i)
FROM generate_series(1, :rows) AS i
"""

FILL_EXPIRED = f"""
INSERT INTO celery_lease_jobs {_COLUMNS}
SELECT gen_random_uuid(), 'noop', 'bench.lease.noop', 'running', 1, 3, 60, 1, 0,
    'bench-scale/0/dead', now() - interval '1 minute', now() - interval '2 minutes', '{{}}'::jsonb, NULL,
    now() - interval '2 minutes', now() - interval '2 minutes', now() - interval '2 minutes', NULL
FROM generate_series(1, :rows) AS i
"""

FILL_PENDING_FRESH = f"""
INSERT INTO celery_lease_jobs {_COLUMNS}
SELECT gen_random_uuid(), 'noop', 'bench.lease.noop', 'pending', 0, 3, 60, 0, 0,
    NULL, NULL, now(), '{{}}'::jsonb, NULL, now(), now(), NULL, NULL
FROM generate_series(1, :rows) AS i
"""


def timed(fn, samples: int) -> dict:
    fn()  # warm: pool connection, statement compile cache
    ms = []
    for _ in range(samples):
        started = time.perf_counter()
        fn()
        ms.append((time.perf_counter() - started) * 1000)
    return {"median_ms": statistics.median(ms), "p99_ms": percentile(ms, 99)}


def claim(store, job) -> None:
    """The claim of one job (lifecycle.claim.claim_delivery; the claim also matches the task its wakeup was delivered to)."""
    claim_delivery(store, job.id, "bench/0/scale", job.task)


class Scale:
    def __init__(self, leases, task, redis, log) -> None:
        self.leases, self.task, self.redis, self.log = leases, task, redis, log

    def sql(self, statement: str, **params) -> float:
        started = time.monotonic()
        with self.leases.store.durable.begin() as conn:
            conn.execute(sa.text(statement), params)
        return time.monotonic() - started

    def vacuum(self) -> None:
        with self.leases.store.durable.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql("VACUUM ANALYZE celery_lease_jobs")

    def fill(self, statement: str, rows: int, what: str) -> None:
        seconds = self.sql(statement, rows=rows)
        started = time.monotonic()
        self.vacuum()
        self.log(f"inserted {rows:,} {what} rows in {seconds:.1f}s, VACUUM ANALYZE {time.monotonic() - started:.1f}s")

    def drop_live(self) -> None:
        self.sql("DELETE FROM celery_lease_jobs WHERE status IN ('pending', 'running')")
        self.vacuum()
        self.redis.flush()

    def idle(self, samples: int) -> dict:
        leases = self.leases
        figures = {"reap_idle": timed(leases.reap, samples), "sweep_idle": timed(leases.sweep, samples)}
        # Claim: fresh pending jobs (submitted in one batch), each claimed once by primary
        # key; then removed so the next measurement starts alike.
        jobs = iter(self.task.submit_many([{}] * (samples + 1)))
        figures["claim"] = timed(lambda: claim(leases.store, next(jobs)), samples)
        self.drop_live()
        return figures

    def reap(self, rows: int) -> dict:
        self.fill(FILL_EXPIRED, rows, "expired-lease")
        spent, cpu, ticks, done = 0.0, 0.0, 0, 0
        while True:
            started, started_cpu = time.perf_counter(), time.process_time()
            counts = self.leases.reap()
            spent += time.perf_counter() - started
            cpu += time.process_time() - started_cpu
            ticks += 1
            n = sum(counts.values())
            done += n
            if n == 0:
                break
        self.log(f"reaped {done:,} expired leases in {ticks} calls, {spent:.2f}s ({cpu:.2f}s CPU in this process)")
        result = {
            "rows": rows,
            "reaped": done,
            "calls": ticks,
            "seconds": spent,
            "rows_per_s": done / spent if spent else 0.0,
            # Wall time swings with the machine's load; the caller's own CPU (statement
            # rows, wakeup messages, Redis) much less.
            "cpu_seconds": cpu,
        }
        self.drop_live()
        return result

    def sweep_backlog(self, sizes: list[int], samples: int) -> dict:
        out: dict = {}
        have = 0
        for size in sorted(sizes):
            self.fill(FILL_PENDING_FRESH, size - have, "fresh pending")
            have = size
            sent = []

            def tick():
                sent.append(self.leases.sweep())

            out[str(size)] = {**timed(tick, samples), "sent": sum(sent)}
            self.log(f"sweep over {size:,} fresh pending jobs: {out[str(size)]}")
        self.drop_live()
        return out


def measure(args, log, redis) -> dict:
    """Every scale figure; returns them (also written to results/scale.json)."""
    dbs = harness.Databases()
    try:
        url = dbs.create("scale")
        app, leases, tasks = make_app(url, redis.url, sweep_stale_seconds=86400.0)
        leases.create_schema()
        scale = Scale(leases, tasks["noop"], redis, log)
        results: dict = {"rows": args.rows, "expired": args.expired, "backlog": args.backlog, "samples": args.samples}
        results["empty"] = scale.idle(args.samples)
        log(f"empty table: {results['empty']}")
        scale.fill(FILL_TERMINAL, args.rows, "terminal")
        results["full"] = scale.idle(args.samples)
        log(f"{args.rows:,} terminal rows: {results['full']}")
        if args.expired:
            results["reap_expired"] = scale.reap(args.expired)
        if args.backlog:
            results["sweep_backlog"] = scale.sweep_backlog(args.backlog, args.sweep_samples)
        leases.store.dispose()
        app.close()
    finally:
        dbs.close()
    return results


def markdown(results: dict) -> str:
    rows = results["rows"]
    lines = [
        f"| figure | empty table: median / p99 ms | {rows:,} terminal rows: median / p99 ms |",
        "|---|---:|---:|",
    ]
    names = {
        "reap_idle": "leases.reap(), nothing to reap",
        "sweep_idle": "leases.sweep(), nothing to sweep",
        "claim": "claim (store.claim of a pending job)",
    }
    for key, name in names.items():
        e, f = results["empty"][key], results["full"][key]
        lines.append(f"| {name} | {e['median_ms']:.3f} / {e['p99_ms']:.3f} | {f['median_ms']:.3f} / {f['p99_ms']:.3f} |")
    lines.append("")
    reap = results.get("reap_expired")
    if reap:
        lines.append(
            f"Reaping {reap['rows']:,} expired leases (requeued, wakeups published) beside {rows:,} terminal rows: "
            f"{reap['reaped']:,} rows in {reap['calls']} calls, {reap['seconds']:.2f}s, **{reap['rows_per_s']:,.0f} rows/s**"
            + (f" ({reap['cpu_seconds']:.2f}s of it CPU in the calling process)." if "cpu_seconds" in reap else ".")
        )
        lines.append("")
    backlog = results.get("sweep_backlog")
    if backlog:
        lines += ["| fresh pending backlog | sweep tick median / p99 ms | wakeups sent |", "|---:|---:|---:|"]
        for size, fig in backlog.items():
            lines.append(f"| {int(size):,} | {fig['median_ms']:.3f} / {fig['p99_ms']:.3f} | {fig['sent']} |")
    return "\n".join(lines) + "\n"


def write(results: dict, directory: Path) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "scale.json").write_text(json.dumps(results, indent=2))
    text = markdown(results)
    (directory / "scale.md").write_text(text)
    return text


def main(args, log) -> int:
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        redis = harness.RedisServer(Path(tmp))
        redis.start()
        try:
            results = measure(args, log, redis)
        finally:
            redis.stop()
    print(write(results, args.results))
    return 0
