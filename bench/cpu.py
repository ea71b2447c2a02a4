"""CPU per job by process, during a drain; and ``python -m bench cpu``.

:class:`CpuMeter` reads CPU seconds (user + system, from /proc through psutil) of every
process that works for a system while its worker drains a backlog:

* the worker's main process and its pool children (or the one worker process of
  procrastinate / pgqueuer);
* PostgreSQL: the backends connected to the system's own database (matched by their
  process title, which names the database), not counting the bench's own polling
  backend, and apart from them the cluster's shared processes (WAL writer,
  checkpointer, background writer), which also serve any other database on the
  cluster: on a busy machine that column is noise;
* the private redis-server of the run.

The meter starts once the worker is warm and idle: Celery-based workers start *held*
(consuming a queue nothing is sent to) and are released with ``add_consumer``, so
imports, forks and connection set-up are not counted. On a 2-core machine the total
bounds throughput: C CPU-µs per job caps a drain at 2 / C jobs per µs, and a prefork
worker's main process (one core at most) caps it again on its own.

``python -m bench cpu`` runs only that: N no-op jobs drained by plain Celery and by
celery-lease on PostgreSQL, interleaved repetitions, medians per job.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import psutil

from bench import harness

#: The columns of the CPU table, in order.
PARTS = ("main", "children", "postgres", "postgres_shared", "redis")
PART_LABELS = {
    "main": "worker main",
    "children": "pool children",
    "postgres": "PostgreSQL backends",
    "postgres_shared": "PostgreSQL shared",
    "redis": "Redis",
}
_SHARED = ("walwriter", "checkpointer", "background writer")


def _cpu(proc: psutil.Process) -> float | None:
    try:
        t = proc.cpu_times()
        return t.user + t.system
    except psutil.NoSuchProcess:
        return None


class CpuMeter:
    """CPU seconds by part between start() and stop() for one running worker."""

    def __init__(self, worker: harness.WorkerProcess, system, redis_pid: int) -> None:
        self.worker = worker
        self.system = system
        self.redis_pid = redis_pid
        self._before: dict[tuple[str, int], float] = {}

    def _processes(self) -> dict[tuple[str, int], psutil.Process]:
        found: dict[tuple[str, int], psutil.Process] = {}
        try:
            main = psutil.Process(self.worker.proc.pid)
            found[("main", main.pid)] = main
            for child in main.children(recursive=True):
                found[("children", child.pid)] = child
        except psutil.NoSuchProcess:
            pass
        found[("redis", self.redis_pid)] = psutil.Process(self.redis_pid)
        db = None if self.system.db is None else self.system.db.rsplit("/", 1)[-1].split("?")[0]
        mine = self.system.bench_backend_pids()
        for proc in psutil.process_iter(["name", "cmdline"]):
            if proc.info["name"] != "postgres" or proc.pid in mine:
                continue
            title = " ".join(proc.info["cmdline"] or [])
            if db is not None and f" {db} " in title:
                found[("postgres", proc.pid)] = proc
            elif any(name in title for name in _SHARED):
                found[("postgres_shared", proc.pid)] = proc
        return found

    def _sample(self) -> dict[tuple[str, int], float]:
        out = {}
        for key, proc in self._processes().items():
            value = _cpu(proc)
            if value is not None:
                out[key] = value
        return out

    def start(self) -> None:
        self._before = self._sample()

    def stop(self) -> dict[str, float]:
        """CPU seconds by part since start() (a process born since counts from zero)."""
        parts = dict.fromkeys(PARTS, 0.0)
        for key, value in self._sample().items():
            parts[key[0]] += value - self._before.get(key, 0.0)
        return parts


def per_job_us(parts: dict[str, float], jobs: int) -> dict[str, float]:
    us = {k: v * 1e6 / jobs for k, v in parts.items()}
    us["total"] = sum(us[k] for k in PARTS)
    return us


def table(rows: list[tuple[str, float, dict[str, float]]], title: str) -> str:
    """Markdown: one row per system, CPU µs per job by part."""
    lines = [
        title,
        "",
        "| system | drain jobs/s | " + " | ".join(PART_LABELS[p] for p in PARTS) + " | total |",
        "|---|---:|" + "---:|" * (len(PARTS) + 1),
    ]
    for label, rate, us in rows:
        lines.append(f"| {label} | {rate:,.0f} | " + " | ".join(f"{us[p]:,.0f}" for p in PARTS) + f" | {us['total']:,.0f} |")
    return "\n".join(lines) + "\n"


def main(args, log) -> int:
    from bench.run import wait_completed
    from bench.systems import make_systems

    dbs = harness.Databases()
    results: dict[str, list[tuple[float, dict[str, float]]]] = {}
    labels = {}
    with tempfile.TemporaryDirectory(prefix="bench-cpu-") as tmp:
        redis = harness.RedisServer(Path(tmp))
        redis.start()
        try:
            systems = make_systems(["celery", "lease-pg"], dbs, redis.url, Path(tmp))
            for rep in range(1, args.reps + 1):
                for system in systems:
                    out = Path(tmp) / f"{system.name}-{rep}"
                    out.mkdir()
                    system.reset(out)
                    redis.flush()
                    system.submit_batch("noop", args.n, 1000)
                    system.close()
                    worker = harness.WorkerProcess(system.worker_args(hold=True), system.env(redis.url, out), out).start()
                    try:
                        meter = CpuMeter(worker, system, redis.proc.pid)
                        system.completed(out)  # the polling connection is open before the meter starts
                        meter.start()
                        system.release()
                        wait_completed(system, out, args.n, 600, log, "no-op jobs")
                        parts = meter.stop()
                        recs = system.records(out)
                        rate = len(recs) / (max(e for _, e in recs) - min(s for s, _ in recs))
                    finally:
                        worker.stop()
                        system.close()
                    us = per_job_us(parts, args.n)
                    results.setdefault(system.name, []).append((rate, us))
                    labels[system.name] = system.label
                    log(f"rep {rep} {system.label}: {rate:,.0f} jobs/s, {us['total']:,.0f} CPU µs per job")
        finally:
            redis.stop()
            dbs.close()
    rows = []
    for name, cells in results.items():
        rate = statistics.median(r for r, _ in cells)
        us = {k: statistics.median(c[k] for _, c in cells) for k in (*PARTS, "total")}
        rows.append((labels[name], rate, us))
    text = table(rows, f"`python -m bench cpu --n {args.n} --reps {args.reps}`: CPU µs per no-op job during a drain (medians).")
    if "lease-pg" in results and "celery" in results:
        extra = statistics.median(
            lease[1]["total"] - plain[1]["total"] for lease, plain in zip(results["lease-pg"], results["celery"])
        )
        text += f"\ncelery-lease (PostgreSQL) over plain Celery, same repetition (median): {extra:+,.0f} µs per job.\n"
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "cpu.md").write_text(text)
    print(text)
    return 0
