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
import threading
import time
from pathlib import Path

import psutil
import sqlalchemy as sa

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

#: Each PostgreSQL system's job table, whose updates' HOT fraction is reported.
JOB_TABLES = {"procrastinate": "procrastinate_jobs", "pgqueuer": "pgqueuer"}
#: Backends publish their table and WAL counters at most once a second (and within a
#: second of going idle): read them this long after the drain.
SETTLE_SECONDS = 1.2

#: The WAL records written since :start, grouped: a record touches one of the database's
#: relations (``own``), or is a commit record, or neither (pg_walinspect). Read in short
#: chunks while the drain runs: on a busy cluster the segments of a long window may be
#: recycled before it ends.
_WAL_CHUNK = """
SELECT xid::text AS xid, block_ref LIKE :rel AS own,
       resource_manager = 'Transaction' AND record_type LIKE 'COMMIT%%' AS commit,
       sum(record_length) AS bytes, count(*) AS n
FROM pg_get_wal_records_info(CAST(:start AS pg_lsn), CAST(:stop AS pg_lsn))
GROUP BY 1, 2, 3
"""
#: The WAL window is bounded by the *flushed* position: pg_walinspect (PostgreSQL 15)
#: refuses a start past it ("cannot accept future start LSN"), and celery-lease's
#: asynchronous commits leave the insert position ahead of it (every celery-lease
#: cell lost its WAL bytes to that).
#: The flushed position, and whether it moved past :start (an empty window is refused).
_FLUSHED = "SELECT CAST(pg_current_wal_flush_lsn() AS text), pg_current_wal_flush_lsn() > CAST(:start AS pg_lsn)"
_CLUSTER_WAL = "SELECT CAST(pg_current_wal_flush_lsn() AS text), wal_write, wal_sync FROM pg_stat_wal"
_TABLE_UPDATES = (
    "SELECT coalesce(sum(n_tup_upd), 0), coalesce(sum(n_tup_hot_upd), 0) FROM pg_stat_user_tables WHERE relname = :table"
)
#: Seconds between WAL chunks.
WAL_POLL = 0.5


def job_table(system_name: str) -> str:
    return JOB_TABLES.get(system_name, "celery_lease_jobs")


class PgMeter:
    """What one PostgreSQL system's database did over the drain: the WAL bytes and commit
    records of its own transactions (pg_walinspect: records that touch its relations,
    and every record of a transaction that did; exact per database, the cluster's
    other databases left out), WAL writes and fsyncs (pg_stat_wal: the whole cluster,
    so other databases' commits count too), and its job table's updates, HOT or not
    (pg_stat_user_tables).

    Reads on one connection of its own in the system's database, whose backend the CPU
    meter leaves out (pid)."""

    @classmethod
    def of(cls, system) -> PgMeter | None:
        """The meter of a PostgreSQL system (None for the others). Start it before the
        worker: procrastinate and pgqueuer drain from the moment they start."""
        return None if system.db is None else cls(system.db, job_table(system.name))

    def __init__(self, url: str, table: str) -> None:
        self.url, self.table = url, table
        self.pid: int | None = None
        self.error: str | None = None

    def _counters(self) -> dict:
        lsn, writes, syncs = self._conn.exec_driver_sql(_CLUSTER_WAL).one()
        upd, hot = self._conn.execute(sa.text(_TABLE_UPDATES), {"table": self.table}).one()
        return {"lsn": lsn, "wal_write": int(writes), "wal_sync": int(syncs), "upd": int(upd), "hot": int(hot)}

    def start(self) -> None:
        self._engine = sa.create_engine(self.url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
        self._conn = self._engine.connect()
        self._conn.exec_driver_sql("CREATE EXTENSION IF NOT EXISTS pg_walinspect")  # superuser, throwaway database
        self.pid = self._conn.exec_driver_sql("SELECT pg_backend_pid()").scalar()
        dboid = self._conn.exec_driver_sql("SELECT oid FROM pg_database WHERE datname = current_database()").scalar()
        self._rel = f"% rel %/{dboid}/%"
        self._start = self._counters()
        self._lsn = self._start["lsn"]
        self._xids: set[str] = set()
        self.wal_bytes, self.commits = 0, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="bench-wal", daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._done.wait(WAL_POLL):
            self._advance()

    def _advance(self) -> None:
        if self.error is not None:
            return
        stop, moved = self._conn.execute(sa.text(_FLUSHED), {"start": self._lsn}).one()
        if not moved:
            return
        try:
            rows = self._conn.execute(sa.text(_WAL_CHUNK), {"start": self._lsn, "stop": stop, "rel": self._rel}).all()
        except sa.exc.DBAPIError as exc:  # e.g. a segment recycled already: no figure
            self.error = str(exc.orig).strip()
            return
        self._lsn = stop
        for r in rows:  # own records first: a commit in the same chunk is then known
            if r.own:
                self.wal_bytes += int(r.bytes)
                if r.xid != "0":
                    self._xids.add(r.xid)
        for r in rows:
            if not r.own and r.xid in self._xids:
                self.wal_bytes += int(r.bytes)
                self.commits += int(r.n) if r.commit else 0

    def mark_stop(self) -> None:
        """The end of the WAL window (right after the drain), once what the drain wrote
        is flushed (an asynchronous commit's records within the WAL writer's delay)."""
        self._done.set()
        self._thread.join()
        written = self._conn.exec_driver_sql("SELECT CAST(pg_current_wal_insert_lsn() AS text)").scalar()
        deadline = time.monotonic() + 2.0
        while not self._flushed(written) and time.monotonic() < deadline:
            time.sleep(0.05)
        self._advance()

    def _flushed(self, lsn: str) -> bool:
        return self._conn.execute(sa.text("SELECT pg_current_wal_flush_lsn() >= CAST(:lsn AS pg_lsn)"), {"lsn": lsn}).scalar()

    def per_job(self, jobs: int) -> dict[str, float]:
        time.sleep(SETTLE_SECONDS)  # backends publish their counters within a second
        try:
            end = self._counters()
        finally:
            self._conn.close()
            self._engine.dispose()
        a = self._start
        upd = end["upd"] - a["upd"]
        out = {
            "pg_fsyncs_per_job": (end["wal_sync"] - a["wal_sync"]) / jobs,
            "pg_wal_writes_per_job": (end["wal_write"] - a["wal_write"]) / jobs,
            "hot_fraction": (end["hot"] - a["hot"]) / upd if upd else 0.0,
            "updates_per_job": upd / jobs,
        }
        if self.error is None:
            out.update({"pg_wal_bytes_per_job": self.wal_bytes / jobs, "pg_commits_per_job": self.commits / jobs})
        else:  # in latest.json beside the cell; the table shows "–"
            out["pg_wal_error"] = self.error
        return out


def _cpu(proc: psutil.Process) -> float | None:
    try:
        t = proc.cpu_times()
        return t.user + t.system
    except psutil.NoSuchProcess:
        return None


class CpuMeter:
    """CPU seconds by part between start() and stop() for one running worker."""

    def __init__(self, worker: harness.WorkerProcess, system, redis_pid: int, pg: PgMeter | None = None) -> None:
        self.worker = worker
        self.system = system
        self.redis_pid = redis_pid
        self._before: dict[tuple[str, int], float] = {}
        #: Started by the caller (before the worker); its window ends with stop().
        self.pg = pg

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
        mine = self.system.bench_backend_pids() | ({self.pg.pid} if self.pg is not None else set())
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
        if self.pg is not None:
            self.pg.mark_stop()
        return parts

    def pg_per_job(self, jobs: int) -> dict[str, float]:
        """The database's figures per job over the same window (PgMeter); {} without one.
        Takes SETTLE_SECONDS: call once the timing-sensitive reads are done."""
        return {} if self.pg is None else self.pg.per_job(jobs)


def per_job_us(parts: dict[str, float], jobs: int) -> dict[str, float]:
    us = {k: v * 1e6 / jobs for k, v in parts.items()}
    us["total"] = sum(us[k] for k in PARTS)
    return us


#: The database's figures per drained job (PgMeter.per_job), as table columns.
PG_COLUMNS = {
    "pg_wal_bytes_per_job": ("WAL bytes", ",.0f"),
    "pg_commits_per_job": ("commits", ".2f"),
    "pg_fsyncs_per_job": ("WAL fsyncs (cluster)", ".2f"),
    "hot_fraction": ("HOT updates", ".0%"),
}


def pg_cells(figures: dict) -> list[str]:
    return ["–" if figures.get(k) is None else format(figures[k], spec) for k, (_, spec) in PG_COLUMNS.items()]


def table(rows: list[tuple[str, float, dict[str, float], dict]], title: str) -> str:
    """Markdown: one row per system, CPU µs per job by part, then its database's WAL,
    commits, fsyncs and HOT fraction per job."""
    lines = [
        title,
        "",
        "| system | drain jobs/s | "
        + " | ".join(PART_LABELS[p] for p in PARTS)
        + " | total | "
        + " | ".join(label for label, _ in PG_COLUMNS.values())
        + " |",
        "|---|---:|" + "---:|" * (len(PARTS) + 1 + len(PG_COLUMNS)),
    ]
    for label, rate, us, pg in rows:
        cells = [f"{us[p]:,.0f}" for p in PARTS] + [f"{us['total']:,.0f}"] + pg_cells(pg)
        lines.append(f"| {label} | {rate:,.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(args, log) -> int:
    from bench.run import wait_completed
    from bench.systems import make_systems

    dbs = harness.Databases()
    results: dict[str, list[tuple[float, dict[str, float], dict[str, float]]]] = {}
    labels = {}
    with tempfile.TemporaryDirectory(prefix="bench-cpu-") as tmp:
        redis = harness.RedisServer(Path(tmp))
        redis.start()
        try:
            systems = make_systems(args.systems, dbs, redis.url, Path(tmp))
            for rep in range(1, args.reps + 1):
                for system in systems:
                    out = Path(tmp) / f"{system.name}-{rep}"
                    out.mkdir()
                    system.reset(out)
                    redis.flush()
                    system.submit_batch("noop", args.n, 1000)
                    system.close()
                    pg = PgMeter.of(system)
                    if pg is not None:
                        pg.start()
                    hold = system.holdable
                    worker = harness.WorkerProcess(system.worker_args(hold=hold), system.env(redis.url, out), out).start()
                    try:
                        meter = CpuMeter(worker, system, redis.proc.pid, pg)
                        system.completed(out)  # the polling connection is open before the meter starts
                        meter.start()
                        if hold:
                            system.release()
                        wait_completed(system, out, args.n, 600, log, "no-op jobs")
                        parts = meter.stop()
                        recs = system.records(out)
                        rate = len(recs) / (max(e for _, e in recs) - min(s for s, _ in recs))
                        pg_figures = meter.pg_per_job(args.n)
                    finally:
                        worker.stop()
                        system.close()
                    us = per_job_us(parts, args.n)
                    results.setdefault(system.name, []).append((rate, us, pg_figures))
                    labels[system.name] = system.label
                    log(f"rep {rep} {system.label}: {rate:,.0f} jobs/s, {us['total']:,.0f} CPU µs per job, {pg_figures}")
        finally:
            redis.stop()
            dbs.close()
    rows = []
    for name, cells in results.items():
        rate = statistics.median(r for r, _, _ in cells)
        us = {k: statistics.median(c[k] for _, c, _ in cells) for k in (*PARTS, "total")}
        pg = {k: statistics.median(p[k] for _, _, p in cells) for k in cells[0][2]}
        rows.append((labels[name], rate, us, pg))
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
