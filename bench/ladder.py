"""``python -m bench scale``: do claims, outcomes, ticks, reads and pruning stay flat from
100k to 10M jobs?

For each size N of ``--sizes`` (default 100,000 and 10,000,000; ``--quick``: 100,000 and
1,000,000), on a throwaway PostgreSQL database and a private Redis:

1. **the table**: N finished jobs over 30 days plus 10,000 live ones and the last three
   days' run events (bench.dashboard's fill: five kinds, four tenants, runs), and one
   more "day" of ``--prune-day`` finished jobs 40 days old (default 1,000,000; quick:
   100,000), then ``VACUUM ANALYZE``. The fill drops the jobs table's secondary indexes
   and builds them again afterwards (bench set-up: the fastest way to a large table;
   the indexes are exactly the migrations').
2. **claim and outcome**: ``--samples`` fresh jobs submitted in one batch, each claimed
   (``lifecycle.claim.claim_delivery``) then succeeded (the ``succeed`` transition, the
   write a worker makes when a body returns), each call timed alone.
3. **idle ticks**: ``leases.reap()`` and ``leases.sweep()`` with nothing to do.
4. **reads**: the dashboard's jobs page (newest, status failed, a kind) and the API's
   filtered lists (``/api/v1/jobs`` by status, by kind, by status and kind), served by
   uvicorn in this process, median of ``--reads`` requests each after a warm-up.
5. **pruning a day**: ``leases.prune(older_than=35 days)``, called until it finds nothing
   (each call is one of beat's bounded ticks), removes the old day; its wall time, and
   the jobs table's size and dead tuples (``pgstattuple_approx``) before and
   after. Autovacuum is off for the jobs table during the whole run, so the dead tuples
   counted are the prune's own.

Writes bench/results/scale-ladder.{json,md}: one row per figure, one column per size, and
the ratio of the largest size to the smallest.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import sqlalchemy as sa

from bench import dashboard, harness
from bench.run import percentile
from celery_lease.lifecycle import transition as tr
from celery_lease.lifecycle.claim import claim_delivery
from celery_lease.worker.attempt import Attempt

JOBS = "celery_lease_jobs"
DAY_AGE = 40 * 86400
PRUNE_OLDER_THAN = 35 * 86400

FILL_OLD_DAY = f"""
INSERT INTO {JOBS} (id, kind, task, status, attempt, max_attempts, lease_seconds, lease_generation, lease_losses,
    payload, result, tenant, created_at, updated_at, started_at, finished_at)
SELECT gen_random_uuid(), 'extract', 'bench.dash.extract', 'succeeded', 1, 3, 60, 1, 0,
    jsonb_build_object('n', i), jsonb_build_object('rows', i % 5000), (ARRAY['acme', 'globex', NULL])[1 + i % 3],
    t, t, t, t
FROM (SELECT i, now() - make_interval(secs => {DAY_AGE} + i * 86400.0 / :rows) AS t
      FROM generate_series(1, :rows) AS i) AS g
"""

READS = [
    ("dashboard: jobs, newest page", "/dashboard/jobs"),
    ("dashboard: jobs, status failed", "/dashboard/jobs?status=failed"),
    ("dashboard: jobs, kind load", "/dashboard/jobs?kind=load"),
    ("API: jobs by status (failed)", "/api/v1/jobs?status=failed&limit=50"),
    ("API: jobs by kind (extract)", "/api/v1/jobs?kind=extract&limit=50"),
    ("API: jobs by status and kind", "/api/v1/jobs?status=succeeded&kind=notify&limit=50"),
]


def _timed(fn, samples: int) -> dict:
    fn()  # warm: pool connection, statement caches
    ms = []
    for _ in range(samples):
        started = time.perf_counter()
        fn()
        ms.append((time.perf_counter() - started) * 1000)
    return {"p50_ms": statistics.median(ms), "p99_ms": percentile(ms, 99)}


class Table:
    """The jobs table of one size's database: fill, sizes, dead tuples."""

    def __init__(self, url: str, log) -> None:
        self.engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
        self.log = log

    def sql(self, statement: str, **params):
        with self.engine.connect() as conn:
            return conn.execute(sa.text(statement), params)

    def fill(self, rows: int, prune_day: int) -> None:
        self.sql("CREATE EXTENSION IF NOT EXISTS pgstattuple")
        self.sql(f"ALTER TABLE {JOBS} SET (autovacuum_enabled = off)")
        indexes = self.sql(
            "SELECT i.indexname, i.indexdef FROM pg_indexes i JOIN pg_class c ON c.relname = i.indexname"
            " JOIN pg_index x ON x.indexrelid = c.oid WHERE i.tablename = :t AND NOT x.indisprimary",
            t=JOBS,
        ).all()
        for name, _ in indexes:
            self.sql(f'DROP INDEX "{name}"')
        started = time.monotonic()
        dashboard.seed(str(self.engine.url), rows, self.log)
        self.sql(FILL_OLD_DAY, rows=prune_day)
        self.log(f"filled {rows:,} + {prune_day:,} old finished jobs in {time.monotonic() - started:.0f}s")
        started = time.monotonic()
        for _, definition in indexes:
            self.sql(definition)
        self.sql("VACUUM ANALYZE")
        self.log(f"built {len(indexes)} indexes and vacuumed in {time.monotonic() - started:.0f}s")

    def shape(self) -> dict:
        size, dead = self.sql(f"SELECT pg_total_relation_size('{JOBS}'), (pgstattuple_approx('{JOBS}')).dead_tuple_count").one()
        return {"total_bytes": int(size), "dead_tuples": int(dead)}

    def dispose(self) -> None:
        self.engine.dispose()


def claim_and_outcome(leases, task, samples: int) -> dict:
    """p50/p99 of a claim and of a success write, each of ``samples`` fresh jobs."""
    store, pipeline = leases.store, leases.lifecycle
    jobs = task.submit_many([{}] * (samples + 1))
    claimed, claims, outcomes = [], [], []
    for job in jobs:
        started = time.perf_counter()
        row = claim_delivery(store, job.id, "bench/0/scale", task.name)
        claims.append((time.perf_counter() - started) * 1000)
        claimed.append(Attempt.from_claim(job.id, dict(row)))
    for attempt in claimed:
        started = time.perf_counter()
        pipeline.execute(tr.SUCCEED, {"new_result": None, "new_progress": None}, attempt=attempt)
        outcomes.append((time.perf_counter() - started) * 1000)
    # The first of each paid for the pool's connection and the statement caches.
    claims, outcomes = claims[1:], outcomes[1:]
    return {
        "claim": {"p50_ms": statistics.median(claims), "p99_ms": percentile(claims, 99)},
        "outcome": {"p50_ms": statistics.median(outcomes), "p99_ms": percentile(outcomes, 99)},
    }


def reads(serving: dashboard.Serving, samples: int, log) -> dict:
    out = {}
    client = serving.client(dashboard.ADMIN)
    try:
        headers = {"Authorization": f"Bearer {dashboard.ADMIN}"}
        for what, path in READS:

            def get(path=path):
                r = client.get(path, headers=headers if path.startswith("/api/") else None)
                assert r.status_code == 200, f"{path}: {r.status_code} {r.text[:200]}"

            out[what] = _timed(get, samples)
            log(f"{what}: {out[what]['p50_ms']:.1f} ms")
    finally:
        client.close()
    return out


def one_size(rows: int, args, log, redis) -> dict:
    dbs = harness.Databases()
    try:
        url = dbs.create("ladder")
        app, leases = dashboard.make_app(url, redis.url, sweep_stale_seconds=86400.0)
        app.conf.lease_api_rate = 1e6  # the bench is the only client: measure reads, not the throttle
        leases.create_schema()
        table = Table(url, log)
        table.fill(rows, args.prune_day)
        while sum(leases.reap().values()):  # the fill's lapsed leases, before "idle" means idle
            pass
        figures: dict = {"rows": rows, "prune_day": args.prune_day}
        figures.update(claim_and_outcome(leases, app.tasks["bench.dash.extract"], args.samples))
        figures["reap_idle"] = _timed(leases.reap, args.samples)
        figures["sweep_idle"] = _timed(leases.sweep, args.samples)
        serving = dashboard.Serving(leases)
        try:
            figures["reads"] = reads(serving, args.reads, log)
        finally:
            serving.stop()
        before = table.shape()
        # One prune call is one bounded tick (beat's); the day is gone when a tick finds
        # nothing more.
        started, pruned, ticks = time.perf_counter(), 0, 0
        while n := leases.prune(older_than=PRUNE_OLDER_THAN):
            pruned, ticks = pruned + n, ticks + 1
        seconds = time.perf_counter() - started
        after = table.shape()
        figures["prune"] = {"jobs": pruned, "ticks": ticks, "seconds": seconds, "before": before, "after": after}
        log(f"{rows:,} rows: pruned {pruned:,} in {seconds:.2f}s; {before} -> {after}")
        table.dispose()
        leases.store.dispose()
        app.close()
        return figures
    finally:
        dbs.close()


def markdown(results: list[dict]) -> str:
    sizes = [r["rows"] for r in results]
    head = "| figure | " + " | ".join(f"{n:,} rows" for n in sizes) + f" | {sizes[-1]:,} / {sizes[0]:,} |"
    lines = [head, "|---|" + "---:|" * (len(sizes) + 1)]

    def row(name: str, values: list[float], fmt: str = "{:.2f} ms") -> None:
        ratio = values[-1] / values[0] if values[0] else float("nan")
        lines.append(f"| {name} | " + " | ".join(fmt.format(v) for v in values) + f" | {ratio:.2f}x |")

    for key, name in (
        ("claim", "claim"),
        ("outcome", "outcome (succeed)"),
        ("reap_idle", "idle reap tick"),
        ("sweep_idle", "idle sweep tick"),
    ):
        row(f"{name} p50", [r[key]["p50_ms"] for r in results])
        row(f"{name} p99", [r[key]["p99_ms"] for r in results])
    for what, _ in READS:
        row(f"{what} p50", [r["reads"][what]["p50_ms"] for r in results], "{:.1f} ms")
    row("prune a day: seconds", [r["prune"]["seconds"] for r in results], "{:.2f} s")
    row("prune a day: jobs", [r["prune"]["jobs"] for r in results], "{:,.0f}")
    for when in ("before", "after"):
        row(f"jobs table size {when} prune", [r["prune"][when]["total_bytes"] / 2**20 for r in results], "{:,.0f} MiB")
        row(f"jobs table dead tuples {when} prune", [r["prune"][when]["dead_tuples"] for r in results], "{:,.0f}")
    return "\n".join(lines) + "\n"


def main(args, log) -> int:
    if args.quick:
        args.sizes = args.sizes or [100_000, 1_000_000]
        args.prune_day = args.prune_day or 100_000
    args.sizes = args.sizes or [100_000, 10_000_000]
    args.prune_day = args.prune_day or 1_000_000
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-ladder-") as tmp:
        redis = harness.RedisServer(Path(tmp))
        redis.start()
        try:
            for rows in sorted(args.sizes):
                results.append(one_size(rows, args, log, redis))
        finally:
            redis.stop()
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "scale-ladder.json").write_text(json.dumps(results, indent=2))
    text = markdown(results)
    (args.results / "scale-ladder.md").write_text(text)
    print(text)
    return 0
