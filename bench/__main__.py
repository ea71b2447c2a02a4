"""``python -m bench [run] [options]``, ``python -m bench scale | profile | cpu | flow``.

See bench/README.md for what each measures.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    from bench.systems import SYSTEMS

    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    run_p = sub.add_parser("run", help="the side-by-side run (default)")
    for p in (parser, run_p):
        p.add_argument("--n-noop", type=int, default=2000, help="no-op jobs per phase (default 2000)")
        p.add_argument("--n-sleep", type=int, default=500, help="10 ms jobs per phase (default 500)")
        p.add_argument("--reps", type=int, default=3, help="interleaved repetitions (default 3)")
        p.add_argument("--batch", type=int, default=1000, help="jobs per batch submit call (default 1000)")
        p.add_argument(
            "--systems", default=",".join(SYSTEMS), help=f"comma-separated, plain Celery first (default {','.join(SYSTEMS)})"
        )
        p.add_argument("--results", type=Path, default=RESULTS, help="output directory")
    scale_p = sub.add_parser("scale", help="reaper/sweeper idle tick and claim latency vs table size")
    scale_p.add_argument("--rows", type=int, default=1_000_000, help="terminal rows (default 1,000,000)")
    scale_p.add_argument("--samples", type=int, default=300, help="timed calls per figure (default 300)")
    scale_p.add_argument("--results", type=Path, default=RESULTS)
    prof_p = sub.add_parser("profile", help="py-spy one celery-lease pool child during an end-to-end run")
    prof_p.add_argument("--n", type=int, default=20000, help="no-op jobs submitted (default 20000)")
    prof_p.add_argument("--duration", type=int, default=10, help="seconds recorded (default 10)")
    prof_p.add_argument("--results", type=Path, default=RESULTS)
    cpu_p = sub.add_parser("cpu", help="CPU per job by process (worker, pool, PostgreSQL, Redis) during a drain")
    cpu_p.add_argument("--n", type=int, default=6000, help="no-op jobs drained per system (default 6000)")
    cpu_p.add_argument("--results", type=Path, default=RESULTS)
    flow_p = sub.add_parser("flow", help="the cost of a concurrency or rate limit at claim time (~30 s)")
    flow_p.add_argument("--samples", type=int, default=500, help="timed claims per variant (default 500)")
    flow_p.add_argument("--n", type=int, default=1000, help="no-op jobs per drain (default 1000)")
    flow_p.add_argument("--reps", type=int, default=2, help="interleaved drains per kind (default 2)")
    flow_p.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    if args.command == "cpu":
        from bench.cpu import main as cpu_main

        return cpu_main(args, log)

    if args.command == "flow":
        from bench.flow import main as flow_main

        return flow_main(args, log)

    if args.command == "scale":
        from bench.scale import main as scale_main

        return scale_main(args, log)
    if args.command == "profile":
        from bench.profile import main as profile_main

        return profile_main(args, log)
    return run_main(args)


def run_main(args) -> int:
    from bench import harness, report, run
    from bench.systems import make_systems

    names = [s.strip() for s in args.systems.split(",") if s.strip()]
    started = time.monotonic()
    dbs = harness.Databases()
    with tempfile.TemporaryDirectory(prefix="celery-lease-bench-") as tmp:
        workdir = Path(tmp)
        redis = harness.RedisServer(workdir)
        redis.start()
        try:
            systems = make_systems(names, dbs, redis.url, workdir)
            log(f"systems: {', '.join(s.name for s in systems)}; N={args.n_noop} no-op, {args.n_sleep} 10 ms; {args.reps} reps")
            cells = run.run(
                systems,
                n_noop=args.n_noop,
                n_sleep=args.n_sleep,
                reps=args.reps,
                chunk=args.batch,
                workdir=workdir,
                broker=redis,
                dbs=dbs,
                log=log,
            )
            for s in systems:
                s.close()
        finally:
            redis.stop()
            dbs.close()
    rows = run.summarize(cells)
    meta = {
        "when": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{os.cpu_count()} CPUs, Python {platform.python_version()}",
        "n_noop": args.n_noop,
        "n_sleep": args.n_sleep,
        "reps": args.reps,
        "batch": args.batch,
        "systems": names,
        "seconds": round(time.monotonic() - started, 1),
    }
    table = report.write(args.results, meta, cells, rows)
    print(table)
    log(f"done in {meta['seconds']:.0f}s; wrote {args.results}/latest.json, latest.md, latest.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
