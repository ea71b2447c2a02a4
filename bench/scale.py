"""``python -m bench scale``: does the table's terminal history slow the hot path?

Times celery-lease's idle maintenance ticks (``leases.reap()`` and ``leases.sweep()``
with nothing to do: each is one transaction and one statement) and the claim statement
(``store.claim`` of a fresh pending job), first on an empty jobs table, then with
``--rows`` terminal rows (succeeded/failed/cancelled/expired, written with
generate_series in one INSERT, then ANALYZE). Partial indexes should keep all three
flat. Timings are wall time from this process over a loopback connection, so they
include the round trip.
"""

from __future__ import annotations

import json
import statistics
import time

import sqlalchemy as sa

from bench import harness
from bench.apps.lease import make_app
from bench.run import percentile

# Bench setup, not product SQL: the fastest way to a large terminal history.
FILL = """
INSERT INTO celery_lease_jobs (id, kind, task, status, attempt, max_attempts, lease_seconds,
    lease_generation, lease_losses, payload, result, created_at, updated_at, started_at, finished_at)
SELECT gen_random_uuid(), 'noop', 'bench.lease.noop',
    (ARRAY['succeeded', 'failed', 'cancelled', 'expired'])[1 + i % 4], 1, 3, 60, 1, 0,
    '{}'::jsonb, '{"ok": true}'::jsonb,
    now() - make_interval(secs => i), now() - make_interval(secs => i),
    now() - make_interval(secs => i), now() - make_interval(secs => i)
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


def measure(leases, task, samples: int) -> dict:
    figures = {"reap_idle": timed(leases.reap, samples), "sweep_idle": timed(leases.sweep, samples)}
    # Claim: fresh pending jobs (submitted in one batch, their wakeups go nowhere), each
    # claimed once by primary key; then removed so the next measurement starts alike.
    jobs = iter(task.submit_many([{}] * (samples + 1)))
    figures["claim"] = timed(lambda: leases.store.claim(next(jobs).id, "bench/0/scale", task.name), samples)
    with leases.store.durable.begin() as conn:
        conn.exec_driver_sql("DELETE FROM celery_lease_jobs WHERE status IN ('pending', 'running')")
    return figures


def main(args, log) -> int:
    dbs = harness.Databases()
    try:
        url = dbs.create("scale")
        app, leases, tasks = make_app(url, "memory://")
        leases.create_schema()
        results = {"rows": args.rows, "samples": args.samples}
        results["empty"] = measure(leases, tasks["noop"], args.samples)
        log(f"empty table: {results['empty']}")
        started = time.monotonic()
        with leases.store.durable.begin() as conn:
            conn.execute(sa.text(FILL), {"rows": args.rows})
        with leases.store.durable.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql("VACUUM ANALYZE celery_lease_jobs")
        results["fill_seconds"] = round(time.monotonic() - started, 1)
        log(f"inserted {args.rows:,} terminal rows in {results['fill_seconds']}s")
        results["full"] = measure(leases, tasks["noop"], args.samples)
        log(f"{args.rows:,} terminal rows: {results['full']}")
        leases.store.dispose()
    finally:
        dbs.close()
    lines = [
        f"| figure | empty table: median / p99 ms | {args.rows:,} terminal rows: median / p99 ms |",
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
    table = "\n".join(lines) + "\n"
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "scale.json").write_text(json.dumps(results, indent=2))
    (args.results / "scale.md").write_text(table)
    print(table)
    return 0
