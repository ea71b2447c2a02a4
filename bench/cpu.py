"""``python -m bench cpu``: where the CPU of one job goes, by process, during a drain.

For plain Celery and celery-lease (PostgreSQL): N no-op jobs are submitted with the
worker stopped, then the worker drains them. CPU seconds (user + system, from /proc
through psutil) are read for the worker's main process, its pool children, every
PostgreSQL process and the private redis-server, before the worker starts and once the
last job is done, and divided by N. On a 2-core machine the sum bounds throughput:
a system that needs C CPU-µs per job cannot drain faster than 2 / C jobs per µs, and
a prefork worker's main process (one core at most) bounds it again on its own.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import psutil

from bench import harness
from bench.systems import make_systems


def _cpu(procs) -> float:
    total = 0.0
    for proc in procs:
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


def _named(name: str) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["name"]) if (p.info["name"] or "").startswith(name)]


def main(args, log) -> int:
    dbs = harness.Databases()
    redis = harness.RedisServer(Path(tempfile.mkdtemp(prefix="bench-redis-")))
    redis.start()
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="bench-cpu-") as tmp:
            for system in make_systems(["celery", "lease-pg"], dbs, redis.url, Path(tmp)):
                out = Path(tmp) / system.name
                out.mkdir()
                system.reset(out)
                system.submit_batch("noop", args.n, 1000)
                system.close()
                before_pg = {p.pid: _cpu([p]) for p in _named("postgres")}
                before_redis = _cpu([redis_proc(redis)])
                worker = harness.WorkerProcess(system.worker_args(), system.env(redis.url, out), out).start()
                started = time.monotonic()
                harness.wait_for(
                    lambda: system.completed(out) >= args.n, timeout=600, interval=0.1, what=f"{system.label} to drain"
                )
                elapsed = time.monotonic() - started
                main_proc = psutil.Process(worker.proc.pid)
                children = main_proc.children(recursive=True)
                pg = sum(_cpu([p]) - before_pg.get(p.pid, 0.0) for p in _named("postgres"))
                row = {
                    "system": system.label,
                    "jobs/s": args.n / elapsed,
                    "main": _cpu([main_proc]),
                    "children": _cpu(children),
                    "postgres": pg,
                    "redis": _cpu([redis_proc(redis)]) - before_redis,
                }
                worker.stop()
                system.close()
                rows.append(row)
                log(f"{system.label}: {row['jobs/s']:.0f} jobs/s")
    finally:
        redis.stop()
        dbs.close()
    lines = [
        f"`python -m bench cpu --n {args.n}`: CPU µs per no-op job during a drain "
        "(worker start-up included in main and children).",
        "",
        "| system | drain jobs/s | worker main | pool children | PostgreSQL | Redis | total |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        parts = [r[k] * 1e6 / args.n for k in ("main", "children", "postgres", "redis")]
        lines.append(
            f"| {r['system']} | {r['jobs/s']:,.0f} | " + " | ".join(f"{p:,.0f}" for p in parts) + f" | {sum(parts):,.0f} |"
        )
    text = "\n".join(lines) + "\n"
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "cpu.md").write_text(text)
    print(text)
    return 0


def redis_proc(redis) -> psutil.Process:
    return psutil.Process(redis.proc.pid)
