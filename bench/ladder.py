"""``python -m bench scale``: do claims, outcomes, ticks, reads and pruning stay flat from
100k to 10M jobs?

For each size N of ``--sizes`` (default 100,000 and 10,000,000; ``--quick``: 100,000 and
1,000,000), on a throwaway PostgreSQL database and a private Redis:

1. **the fill**: N finished jobs over 30 days plus 10,000 live ones and the last three
   days' run events (bench.dashboard's fill: five kinds, four tenants, runs), and one
   more UTC day of ``--prune-day`` finished jobs 40 days ago (default 1,000,000; quick:
   100,000), all in celery_lease_jobs; then ``VACUUM ANALYZE``. The fill drops the jobs
   table's secondary indexes and builds them again afterwards (bench set-up: the
   fastest way to a large table; the indexes are exactly the migrations').
2. **the archive**: beat's archive tick (``leases.maintenance.archive()``, archive_after
   an hour, ``lease_batch_size`` rows a statement, at most 20 statements a tick) called
   until it moves nothing: every finished job older than an hour, and its run events,
   moves into the history's day partitions, which the archive makes: every UTC day
   from the oldest job's through tomorrow, 42 of each history table, the empty days
   between the old day and the 30 included. Its wall time, rows per second, and the
   jobs table's size and dead tuples before and after: the archive's deletes are where
   the dead tuples of finished jobs now are. Then, bench set-up again, ``VACUUM FULL``
   of the jobs table and ``VACUUM ANALYZE``: the steady state of the design, where
   autovacuum keeps the hot table at the live jobs and the last hour of finished ones
   (a table archived all along never held the rest).
3. **claim and outcome**: ``--samples`` fresh jobs submitted in one batch, each claimed
   (``lifecycle.claim.claim_delivery``) then succeeded (the ``succeed`` transition, the
   write a worker makes when a body returns), each call timed alone.
4. **idle ticks**: ``leases.reap()`` and ``leases.sweep()`` with nothing to do.
5. **reads**: the dashboard's jobs page (newest, status failed, a kind) and the API's
   filtered lists (``/api/v1/jobs`` by status, by kind, by status and kind), served by
   uvicorn in this process, median of ``--reads`` requests each after a warm-up. They
   read through the views celery_lease_jobs_all / celery_lease_events_all.
6. **pruning a day**: one ``leases.prune(older_than=35 days)`` (one beat prune tick),
   which deletes what the hot table holds past the cutoff (nothing: it was archived)
   and drops the old day's history partitions whole. Its wall time; the jobs it removed
   (``count(*)`` of celery_lease_jobs_all before and after) and the days it dropped; and
   before and after it, the size (``pg_total_relation_size``, indexes included) and dead
   tuples (``pgstattuple_approx``) of celery_lease_jobs and of the history (the sum over
   the leaf partitions of celery_lease_history and celery_lease_history_events).
   Autovacuum is off for the jobs table during the whole run, so the dead tuples
   counted there are the archive's and the prune's own.

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
from celery_lease.beat.maintenance import MAX_CHUNKS
from celery_lease.lifecycle import transition as tr
from celery_lease.lifecycle.claim import claim_delivery
from celery_lease.worker.attempt import Attempt

JOBS = "celery_lease_jobs"
HISTORY = ("celery_lease_history", "celery_lease_history_events")
ALL_JOBS = "celery_lease_jobs_all"
DAY_AGE = 40  # days: the pruned day is the whole UTC day 40 days before today
PRUNE_OLDER_THAN = 35 * 86400
ARCHIVE_AFTER = 3600.0

# One UTC day, 00:00 to 24:00, so its jobs fill exactly one partition of the history.
FILL_OLD_DAY = f"""
INSERT INTO {JOBS} (id, kind, task, status, attempt, max_attempts, lease_seconds, lease_generation, lease_losses,
    payload, result, tenant, created_at, updated_at, started_at, finished_at)
SELECT gen_random_uuid(), 'extract', 'bench.dash.extract', 'succeeded', 1, 3, 60, 1, 0,
    jsonb_build_object('n', i), jsonb_build_object('rows', i % 5000), (ARRAY['acme', 'globex', NULL])[1 + i % 3],
    t, t, t, t
FROM (SELECT i, (date_trunc('day', now() AT TIME ZONE 'UTC') - interval '{DAY_AGE} days') AT TIME ZONE 'UTC'
             + make_interval(secs => (i - 1) * 86400.0 / :rows) AS t
      FROM generate_series(1, :rows) AS i) AS g
"""

#: The leaf partitions of both history tables.
LEAVES = " UNION ALL ".join(f"SELECT relid FROM pg_partition_tree('{t}') WHERE isleaf" for t in HISTORY)

READS = [
    ("dashboard: jobs, newest page", "/dashboard/jobs"),
    ("dashboard: jobs, status failed", "/dashboard/jobs?status=failed"),
    ("dashboard: jobs, kind load", "/dashboard/jobs?kind=load"),
    ("API: jobs by status (failed)", "/api/v1/jobs?status=failed&limit=50"),
    ("API: jobs by kind (extract)", "/api/v1/jobs?kind=extract&limit=50"),
    ("API: jobs by status and kind", "/api/v1/jobs?status=succeeded&kind=notify&limit=50"),
    # The history holds no pending job: its status check lets the planner skip it.
    ("API: jobs by status (pending)", "/api/v1/jobs?status=pending&limit=50"),
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
    """The jobs of one size's database: fill, and the hot table's and the history's
    sizes and dead tuples."""

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

    def compact(self) -> None:
        """The steady state after the archive: the hot table rewritten to its live rows
        (what autovacuum keeps it at when finished jobs leave it an hour after they
        finish), and everything vacuumed and analyzed."""
        started = time.monotonic()
        self.sql(f"VACUUM FULL {JOBS}")
        self.sql("VACUUM ANALYZE")
        self.log(f"VACUUM FULL of the jobs table and VACUUM ANALYZE in {time.monotonic() - started:.0f}s")

    def shape(self) -> dict:
        # Dead tuples first: a scan (the counts below) may prune the pages it reads.
        size, dead = self.sql(f"SELECT pg_total_relation_size('{JOBS}'), (pgstattuple_approx('{JOBS}')).dead_tuple_count").one()
        hsize, hdead, partitions = self.sql(
            "SELECT coalesce(sum(pg_total_relation_size(relid)), 0),"
            f" coalesce(sum((pgstattuple_approx(relid)).dead_tuple_count), 0), count(*) FROM ({LEAVES}) AS leaves"
        ).one()
        rows = self.sql(f"SELECT count(*) FROM {JOBS}").scalar_one()
        everything = self.sql(f"SELECT count(*) FROM {ALL_JOBS}").scalar_one()
        return {
            "jobs": {"total_bytes": int(size), "dead_tuples": int(dead), "rows": int(rows)},
            "history": {"total_bytes": int(hsize), "dead_tuples": int(hdead), "partitions": int(partitions)},
            "all_rows": int(everything),
        }

    def dispose(self) -> None:
        self.engine.dispose()


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def archive(leases, table: Table, log) -> dict:
    """Beat's archive tick, called until it moves nothing; its figures."""
    before = table.shape()
    ticks: list[tuple[int, float]] = []
    started = time.perf_counter()
    while True:
        tick = time.perf_counter()
        n = leases.maintenance.archive()
        ticks.append((n, time.perf_counter() - tick))
        if not n:
            break
        if len(ticks) % 25 == 0:
            moved = sum(m for m, _ in ticks)
            log(f"archived {moved:,} in {time.perf_counter() - started:.0f}s ({len(ticks)} ticks)")
    seconds = time.perf_counter() - started
    after = table.shape()
    moved = sum(m for m, _ in ticks)
    full = [s for m, s in ticks if m == MAX_CHUNKS * leases.settings.batch_size]
    out = {
        "jobs": moved,
        "ticks": len(ticks),
        "seconds": seconds,
        "rows_per_s": moved / seconds if seconds else 0.0,
        # A full tick's time at the start and the end of the backlog: flat, or not.
        "first_full_ticks_s": statistics.mean(full[:5]) if full else None,
        "last_full_ticks_s": statistics.mean(full[-5:]) if full else None,
        "tick_seconds": [round(s, 4) for _, s in ticks],
        "before": before,
        "after": after,
    }
    log(
        f"archived {moved:,} jobs in {seconds:.1f}s ({out['rows_per_s']:,.0f} rows/s, {len(ticks)} ticks;"
        f" a full tick {_seconds(out['first_full_ticks_s'])} first, {_seconds(out['last_full_ticks_s'])} last);"
        f" {before} -> {after}"
    )
    return out


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
        pipeline.execute(tr.END, tr.ending_params([tr.Ending.succeeded(attempt, None)]), attempt=attempt)
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
        app, leases = dashboard.make_app(url, redis.url, sweep_stale_seconds=86400.0, archive_after=ARCHIVE_AFTER)
        app.conf.lease_api_rate = 1e6  # the bench is the only client: measure reads, not the throttle
        leases.create_schema()
        table = Table(url, log)
        table.fill(rows, args.prune_day)
        figures: dict = {"rows": rows, "prune_day": args.prune_day}
        figures["archive"] = archive(leases, table, log)
        table.compact()
        while sum(leases.reap().values()):  # the fill's lapsed leases, before "idle" means idle
            pass
        figures.update(claim_and_outcome(leases, app.tasks["bench.dash.extract"], args.samples))
        figures["reap_idle"] = _timed(leases.reap, args.samples)
        figures["sweep_idle"] = _timed(leases.sweep, args.samples)
        serving = dashboard.Serving(leases)
        try:
            figures["reads"] = reads(serving, args.reads, log)
        finally:
            serving.stop()
        before, days_before = table.shape(), leases.store.history_partitions()
        # One prune call is one beat tick: its bounded deletes of the hot table (nothing
        # left there past the cutoff), then the history's old days dropped whole.
        started = time.perf_counter()
        hot = leases.prune(older_than=PRUNE_OLDER_THAN)
        seconds = time.perf_counter() - started
        after, days_after = table.shape(), leases.store.history_partitions()
        dropped = {t: sorted(set(days_before[t]) - set(days_after[t])) for t in days_before}
        figures["prune"] = {
            "jobs": before["all_rows"] - after["all_rows"],
            "hot_jobs": hot,
            "days": len({d for days in dropped.values() for d in days}),
            "dropped": {t: [str(d) for d in days] for t, days in dropped.items()},
            "seconds": seconds,
            "before": before,
            "after": after,
        }
        log(
            f"{rows:,} rows: prune removed {figures['prune']['jobs']:,} jobs ({hot:,} of them from the hot table),"
            f" dropped {figures['prune']['dropped']}, in {seconds:.3f}s; {before} -> {after}"
        )
        if figures["prune"]["jobs"] != args.prune_day:
            log(f"the prune removed {figures['prune']['jobs']:,} jobs, not the old day's {args.prune_day:,}")
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
        ratio = f"{values[-1] / values[0]:.2f}x" if values[0] else "-"
        lines.append(f"| {name} | " + " | ".join(fmt.format(v) for v in values) + f" | {ratio} |")

    mib = "{:,.0f} MiB"
    arch = [r["archive"] for r in results]
    row("archive: jobs moved", [a["jobs"] for a in arch], "{:,.0f}")
    row("archive: seconds", [a["seconds"] for a in arch], "{:,.1f} s")
    row("archive: rows/s", [a["rows_per_s"] for a in arch], "{:,.0f}")
    ticks = " | ".join(f"{_seconds(a['first_full_ticks_s'])} / {_seconds(a['last_full_ticks_s'])}" for a in arch)
    lines.append(f"| archive: a full tick, first five / last five (mean) | {ticks} | |")
    for when in ("before", "after"):
        row(f"jobs table size {when} the archive", [a[when]["jobs"]["total_bytes"] / 2**20 for a in arch], mib)
        row(f"jobs table dead tuples {when} the archive", [a[when]["jobs"]["dead_tuples"] for a in arch], "{:,.0f}")
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
    prune = [r["prune"] for r in results]
    row("prune a day: seconds", [p["seconds"] for p in prune], "{:.3f} s")
    row("prune a day: jobs removed", [p["jobs"] for p in prune], "{:,.0f}")
    row("prune a day: UTC days dropped (the old day, then empty days)", [p["days"] for p in prune], "{:,.0f}")
    for when in ("before", "after"):
        row(f"jobs in all (view) {when} prune", [p[when]["all_rows"] for p in prune], "{:,.0f}")
        row(f"jobs table rows {when} prune", [p[when]["jobs"]["rows"] for p in prune], "{:,.0f}")
        row(f"jobs table size {when} prune", [p[when]["jobs"]["total_bytes"] / 2**20 for p in prune], mib)
        row(f"jobs table dead tuples {when} prune", [p[when]["jobs"]["dead_tuples"] for p in prune], "{:,.0f}")
        row(f"history partitions {when} prune", [p[when]["history"]["partitions"] for p in prune], "{:,.0f}")
        row(f"history size {when} prune", [p[when]["history"]["total_bytes"] / 2**20 for p in prune], mib)
        row(f"history dead tuples {when} prune", [p[when]["history"]["dead_tuples"] for p in prune], "{:,.0f}")
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
