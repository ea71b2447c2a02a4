"""``python -m bench [run] [options]``, ``python -m bench scale | maintenance | profile | cpu | flow | fair | dashboard |
screenshot``.

The default (``run``) measures every system and body side by side, then the scale
figures, and writes bench/results/latest.md: the figures of issue #12 with their goals,
then the details.

See bench/README.md for what each measures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


#: Defaults of `python -m bench` (what `bash dev.sh bench` runs), chosen so the whole run
#: (3 repetitions of 5 systems x 3 bodies, then the scale figures at 1M rows) stays well
#: under 10 minutes on the 2-core development machine (bench/README.md has the timing).
#: --quick checks the harness in a minute or two; its numbers are too noisy to quote.
DEFAULTS = {"n_noop": 1200, "n_sleep1": 400, "n_sleep10": 200, "reps": 3, "scale_rows": 1_000_000}
QUICK = {"n_noop": 300, "n_sleep1": 150, "n_sleep10": 60, "reps": 1, "scale_rows": 100_000}


def _sizes(text: str) -> list[int]:
    return [int(x.replace("_", "")) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    from bench.systems import FACTORIES, SYSTEMS

    # No abbreviations: `bench cpu --n 6000` would otherwise be an ambiguous --n-noop.
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__, allow_abbrev=False)
    sub = parser.add_subparsers(dest="command")
    run_p = sub.add_parser("run", help="the side-by-side run and the scale figures (default)")
    for p in (parser, run_p):
        d = DEFAULTS
        p.add_argument("--quick", action="store_true", help=f"small sizes, one repetition, scale at 100k: {QUICK}")
        p.add_argument("--n-noop", type=int, help=f"no-op jobs per phase (default {d['n_noop']})")
        p.add_argument("--n-sleep1", type=int, help=f"1 ms jobs per phase (default {d['n_sleep1']}; 0 skips)")
        p.add_argument(
            "--n-sleep10",
            "--n-sleep",
            dest="n_sleep10",
            type=int,
            help=f"10 ms jobs per phase (default {d['n_sleep10']}; 0 skips)",
        )
        p.add_argument("--reps", type=int, help=f"interleaved repetitions (default {d['reps']})")
        p.add_argument("--batch", type=int, default=1000, help="jobs per batch submit call (default 1000)")
        p.add_argument(
            "--systems",
            default=",".join(SYSTEMS),
            help=f"comma-separated, plain Celery first (default {','.join(SYSTEMS)}; known: {', '.join(FACTORIES)})",
        )
        p.add_argument(
            "--scale-rows",
            type=int,
            help=f"terminal rows and largest fresh backlog of the scale figures (default {d['scale_rows']:,}; 0 skips them)",
        )
        p.add_argument("--before", type=Path, help="an earlier run's latest.json: adds a 'before' column to the figures")
        p.add_argument("--note", default="", help="a sentence for the report's header (e.g. the machine's load)")
        p.add_argument("--results", type=Path, default=RESULTS, help="output directory")
    ladder_p = sub.add_parser("scale", help="claims, outcomes, ticks, reads and pruning at 100k and 10M jobs")
    ladder_p.add_argument("--quick", action="store_true", help="sizes 100k and 1M, a day of 100k pruned")
    ladder_p.add_argument("--sizes", type=_sizes, default=None, help="job counts (default 100000,10000000)")
    ladder_p.add_argument("--prune-day", type=int, default=None, help="old finished jobs pruned (default 1,000,000)")
    ladder_p.add_argument("--samples", type=int, default=300, help="timed claims, outcomes and ticks (default 300)")
    ladder_p.add_argument("--reads", type=int, default=15, help="timed requests per page or list (default 15)")
    ladder_p.add_argument("--results", type=Path, default=RESULTS)
    scale_p = sub.add_parser("maintenance", help="maintenance ticks, reaping and claims vs table size")
    scale_p.add_argument("--rows", type=int, default=1_000_000, help="terminal rows (default 1,000,000)")
    scale_p.add_argument("--expired", type=int, default=100_000, help="expired leases to reap (default 100,000; 0 skips)")
    scale_p.add_argument(
        "--backlog", type=_sizes, default=[100_000, 1_000_000], help="fresh pending backlogs to sweep (default 100000,1000000)"
    )
    scale_p.add_argument("--samples", type=int, default=300, help="timed calls per idle figure (default 300)")
    scale_p.add_argument("--sweep-samples", type=int, default=20, help="timed sweeps per backlog size (default 20)")
    scale_p.add_argument("--results", type=Path, default=RESULTS)
    prof_p = sub.add_parser("profile", help="py-spy one celery-lease pool child during an end-to-end run")
    prof_p.add_argument("--n", type=int, default=20000, help="jobs submitted (default 20000)")
    prof_p.add_argument("--body", default="noop", choices=("noop", "sleep1", "sleep10"), help="their body (default noop)")
    prof_p.add_argument("--duration", type=int, default=10, help="seconds recorded (default 10)")
    prof_p.add_argument("--results", type=Path, default=RESULTS)
    cpu_p = sub.add_parser("cpu", help="CPU per job by process (worker, pool, PostgreSQL, Redis) during a drain")
    cpu_p.add_argument("--n", type=int, default=6000, help="no-op jobs drained per system (default 6000)")
    cpu_p.add_argument("--reps", type=int, default=1, help="interleaved repetitions (default 1)")
    cpu_p.add_argument(
        "--systems",
        type=lambda v: [s.strip() for s in v.split(",") if s.strip()],
        default=["celery", "lease-pg"],
        help="comma-separated (default celery,lease-pg; add procrastinate,pgqueuer for their database figures)",
    )
    cpu_p.add_argument("--results", type=Path, default=RESULTS)
    flow_p = sub.add_parser("flow", help="the cost of a concurrency or rate limit at claim time (~30 s)")
    flow_p.add_argument("--samples", type=int, default=500, help="timed claims per variant (default 500)")
    flow_p.add_argument("--n", type=int, default=1000, help="no-op jobs per drain (default 1000)")
    flow_p.add_argument("--reps", type=int, default=2, help="interleaved drains per kind (default 2)")
    flow_p.add_argument("--handover", type=int, default=120, help="jobs of a concurrency=1 kind for the handover (default 120)")
    flow_p.add_argument("--only", choices=["all", "handover"], default="all", help="run only the handover part")
    flow_p.add_argument("--results", type=Path, default=RESULTS)
    fair_p = sub.add_parser("fair", help="fair share's claim and submit cost, 1 tenant vs 10,000 (a few minutes)")
    fair_p.add_argument("--rows", type=int, default=1_000_000, help="pending jobs per fair kind (default 1,000,000)")
    fair_p.add_argument("--tenants", type=int, default=10_000, help="tenants of the many-tenant kind (default 10,000)")
    fair_p.add_argument("--samples", type=int, default=500, help="timed claims and submits per kind (default 500)")
    fair_p.add_argument("--results", type=Path, default=RESULTS)
    dash_p = sub.add_parser("dashboard", help="every dashboard page's time with --rows jobs in the table (~3 min at 1M)")
    dash_p.add_argument("--rows", type=int, default=1_000_000, help="finished jobs (default 1,000,000)")
    dash_p.add_argument("--samples", type=int, default=15, help="timed requests per page (default 15)")
    dash_p.add_argument("--database", help="a database a previous run seeded, kept (skips the fill; for re-measuring)")
    dash_p.add_argument("--results", type=Path, default=RESULTS)
    shot_p = sub.add_parser("screenshot", help="seed a demo database, serve it, save docs/img/jobs.png (headless chromium)")
    shot_p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "docs" / "img" / "jobs.png")
    args = parser.parse_args(argv)

    if args.command == "dashboard":
        from bench.dashboard import main as dashboard_main

        return dashboard_main(args, log)

    if args.command == "screenshot":
        from bench.screenshot import main as screenshot_main

        return screenshot_main(args, log)

    if args.command == "cpu":
        from bench.cpu import main as cpu_main

        return cpu_main(args, log)

    if args.command == "fair":
        from bench.fair import main as fair_main

        return fair_main(args, log)

    if args.command == "flow":
        from bench.flow import main as flow_main

        return flow_main(args, log)

    if args.command == "scale":
        from bench.ladder import main as ladder_main

        return ladder_main(args, log)

    if args.command == "maintenance":
        from bench.scale import main as scale_main

        return scale_main(args, log)
    if args.command == "profile":
        from bench.profile import main as profile_main

        return profile_main(args, log)
    base = QUICK if args.quick else DEFAULTS
    for key, value in base.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return run_main(args)


def scale_args(rows: int, results: Path) -> argparse.Namespace:
    """The scale figures of a default run: ``rows`` terminal rows, fresh backlogs of
    rows/10 and rows, and min(rows, 100k) expired leases."""
    return argparse.Namespace(
        rows=rows, expired=min(rows, 100_000), backlog=[rows // 10, rows], samples=300, sweep_samples=20, results=results
    )


def run_main(args) -> int:
    from bench import harness, report, run
    from bench import scale as scale_mod
    from bench.systems import check, make_systems

    names = [s.strip() for s in args.systems.split(",") if s.strip()]
    check(names)
    sizes = {"noop": args.n_noop, "sleep1": args.n_sleep1, "sleep10": args.n_sleep10}
    before = json.loads(args.before.read_text()).get("figures") if args.before else None
    started = time.monotonic()
    dbs = harness.Databases()
    scale = None
    scale_error = ""
    with tempfile.TemporaryDirectory(prefix="celery-lease-bench-") as tmp:
        workdir = Path(tmp)
        redis = harness.RedisServer(workdir)
        redis.start()
        try:
            systems = make_systems(names, dbs, redis.url, workdir)
            log(f"systems: {', '.join(s.name for s in systems)}; N={sizes}; {args.reps} reps")
            cells = run.run(
                systems, sizes=sizes, reps=args.reps, chunk=args.batch, workdir=workdir, broker=redis, dbs=dbs, log=log
            )
            for s in systems:
                s.close()
            dbs.close()
            if args.scale_rows:
                log(f"scale figures at {args.scale_rows:,} rows")
                redis.flush()
                sargs = scale_args(args.scale_rows, args.results)
                try:
                    scale = scale_mod.measure(sargs, log, redis)
                    scale_mod.write(scale, args.results)
                except Exception:  # the side-by-side figures are still worth writing
                    log(f"the scale figures failed:\n{traceback.format_exc()}")
                    scale_error = traceback.format_exc().strip().splitlines()[-1]
        finally:
            redis.stop()
            dbs.close()
    rows = run.summarize(cells)
    meta = {
        "when": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{os.cpu_count()} CPUs, Python {platform.python_version()}, load average {os.getloadavg()[0]:.2f} at the end",
        "sizes": sizes,
        "reps": args.reps,
        "batch": args.batch,
        "systems": names,
        "scale_rows": args.scale_rows,
        "note": args.note + (f" The scale figures failed: {scale_error}" if scale_error else ""),
        "commit": _commit(),
        "seconds": round(time.monotonic() - started, 1),
    }
    table = report.write(args.results, meta, cells, rows, scale, before)
    print(table)
    log(f"done in {meta['seconds']:.0f}s; wrote {args.results}/latest.json, latest.md, latest.png")
    return 0


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=RESULTS.parent, capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


if __name__ == "__main__":
    sys.exit(main())
