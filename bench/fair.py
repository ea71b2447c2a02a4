"""``python -m bench fair``: what fair share costs at claim and submit time, by the number
of tenants (a few minutes: most of it is inserting the rows).

Two fair kinds (``@leases.job(fair=True)``) in one throwaway PostgreSQL database, each
with ``--rows`` (1,000,000) pending jobs made by one ``INSERT ... SELECT
generate_series`` with the keys a submit would have given them: ``noop_fair`` all of
one tenant, ``noop_fair_many`` spread over ``--tenants`` (10,000). Then, interleaved
sample by sample so drift hits both alike:

* the claim (``lifecycle.claim.claim_delivery``, as a worker's delivery runs it: the
  prepared statement, its fair swap and its run event) of a delivery naming one of the
  newest pending jobs, so every claim swaps in the head of the fair order; each claimed
  job is completed, untimed, before the next sample;
* one ``submit`` of each kind (the key's two index probes and the weight's lookup are
  in the INSERT), a random tenant's for ``noop_fair_many``.

The goal (issue #40): the claim's p50 with 10,000 tenants within 1.5x of one tenant's.
Output: ``bench/results/fair.{json,md}``.
"""

from __future__ import annotations

import json
import random
import statistics
import time

import sqlalchemy as sa

from bench import harness
from bench.run import percentile

OWNER = "bench@host/1/fair"
KINDS = {"noop_fair": 1, "noop_fair_many": None}  # kind -> tenants (None: --tenants)

FILL = sa.text(
    """
    INSERT INTO celery_lease_jobs (id, kind, task, queue, status, attempt, max_attempts, lease_seconds,
        lease_generation, lease_losses, payload, tenant, priority, created_at, updated_at, woken_at, fair_key)
    SELECT gen_random_uuid(), :kind, :task, :queue, 'pending', 0, 3, 5, 0, 0, '{}'::jsonb,
        't' || (i % :tenants), 0, now() - interval '1 hour' + i * interval '1 microsecond', now(), now(),
        -- a tenant's n-th job: n steps of 1 (weight 1) from the head, as submits give them
        (i / :tenants + 1)::float8
    FROM generate_series(0, :rows - 1) AS i
    """
)


def fill(leases, tasks, kind: str, tenants: int, rows: int) -> float:
    """``rows`` pending jobs of ``kind`` over ``tenants`` tenants; seconds it took."""
    queue = tasks[kind].submit({}, tenant="t0").queue  # the routed queue, as submits store it
    started = time.monotonic()
    with leases.store.durable.begin() as conn:
        conn.execute(sa.text("DELETE FROM celery_lease_jobs WHERE kind = :k"), {"k": kind})
        conn.execute(FILL, {"kind": kind, "task": tasks[kind].name, "queue": queue, "tenants": tenants, "rows": rows})
    return time.monotonic() - started


def newest(leases, kind: str, n: int) -> list[str]:
    """The ids of the kind's n newest pending jobs: deliveries that never name the head."""
    stmt = sa.text("SELECT id FROM celery_lease_jobs WHERE kind = :k AND status = 'pending' ORDER BY created_at DESC LIMIT :n")
    with leases.store.durable.connect() as conn:
        return [str(r[0]) for r in conn.execute(stmt, {"k": kind, "n": n})]


def measure(leases, tasks, samples: int, tenants: int) -> dict:
    from celery_lease.db.statements import attempt
    from celery_lease.lifecycle import transition as tr
    from celery_lease.lifecycle.claim import claim_delivery
    from celery_lease.status import AttemptOutcome

    store = leases.store
    delivered = {kind: newest(leases, kind, 50) for kind in KINDS}
    claims: dict[str, list[float]] = {k: [] for k in KINDS}
    submits: dict[str, list[float]] = {k: [] for k in KINDS}
    swapped = dict.fromkeys(KINDS, 0)
    rng = random.Random(40)
    for i in range(samples + 5):  # the first 5 warm the connection and prepared statements
        for kind in KINDS:
            job_id = delivered[kind][i % len(delivered[kind])]
            started = time.perf_counter()
            row = claim_delivery(store, job_id, OWNER, tasks[kind].name)
            elapsed = time.perf_counter() - started
            assert row is not None, f"{kind}: nothing claimed"
            swapped[kind] += str(row["id"]) != job_id
            ending = tr.Ending(str(row["id"]), row["lease_generation"], AttemptOutcome.SUCCEEDED)
            store.guarded(attempt.end_jobs(store.dialect), tr.ending_params([ending]))
            tenant = "t0" if kind == "noop_fair" else f"t{rng.randrange(tenants)}"
            started_submit = time.perf_counter()
            tasks[kind].submit({}, tenant=tenant)
            submitted = time.perf_counter() - started_submit
            if i >= 5:
                claims[kind].append(elapsed * 1e6)
                submits[kind].append(submitted * 1e6)

    def summary(values: list[float]) -> dict:
        return {"p50_us": statistics.median(values), "p99_us": percentile(values, 99)}

    return {
        "claim": {k: summary(v) for k, v in claims.items()},
        "submit": {k: summary(v) for k, v in submits.items()},
        "swapped": swapped,
    }


def main(args, log) -> int:
    from bench.apps.lease import make_app

    dbs = harness.Databases()
    results: dict = {"rows": args.rows, "tenants": args.tenants, "samples": args.samples}
    try:
        url = dbs.create("fair")
        app, leases, tasks = make_app(url, None)
        leases.create_schema()
        results["fill_s"] = {}
        for kind, tenants in KINDS.items():
            n = tenants or args.tenants
            results["fill_s"][kind] = fill(leases, tasks, kind, n, args.rows)
            log(f"{kind}: {args.rows:,} pending rows over {n:,} tenant(s) in {results['fill_s'][kind]:.0f} s")
        with leases.store.durable.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT").execute(sa.text("VACUUM ANALYZE celery_lease_jobs"))
        results.update(measure(leases, tasks, args.samples, args.tenants))
        leases.store.dispose()
    finally:
        dbs.close()
    one, many = results["claim"]["noop_fair"], results["claim"]["noop_fair_many"]
    ratio = many["p50_us"] / one["p50_us"]
    results["claim_ratio"] = ratio
    lines = [
        f"Fair kinds, {args.rows:,} pending jobs each; {args.samples} samples, interleaved.",
        "",
        "| | claim p50 µs | claim p99 µs | submit p50 µs | submit p99 µs |",
        "|---|---|---|---|---|",
        *(
            f"| {label} | {results['claim'][k]['p50_us']:.0f} | {results['claim'][k]['p99_us']:.0f} | "
            f"{results['submit'][k]['p50_us']:.0f} | {results['submit'][k]['p99_us']:.0f} |"
            for k, label in (("noop_fair", "1 tenant"), ("noop_fair_many", f"{args.tenants:,} tenants"))
        ),
        "",
        f"claim p50, {args.tenants:,} tenants over 1: {ratio:.2f}x (goal: at most 1.5x); "
        f"claims that swapped in the head: {results['swapped']}",
    ]
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "fair.json").write_text(json.dumps(results, indent=2))
    (args.results / "fair.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if ratio <= 1.5 else 1
