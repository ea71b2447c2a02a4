"""The contenders, each behind the same small interface the runner drives.

A system knows how to prepare its database, start its worker, submit one job or a
batch from the bench process, count completed jobs, and read back (start, end) epoch
times of completed jobs for latency and throughput.

Celery-based systems can also start their worker *held* (consuming a queue nothing is
sent to) and release it with a remote-control ``add_consumer``, so the drain's CPU
accounting (bench/cpu.py) starts with the worker warm and excludes its start-up.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from datetime import datetime, timezone
from pathlib import Path

import sqlalchemy as sa

from bench import harness

#: Celery's worker options, the same for plain Celery and celery-lease. WARNING keeps
#: both from logging two lines per task; mingle/gossip/heartbeat are off as in the tests.
CELERY_WORKER = [
    "worker",
    "-P",
    "prefork",
    "-c",
    "2",
    "-l",
    "WARNING",
    "--without-mingle",
    "--without-gossip",
    "--without-heartbeat",
]
#: The queue a held Celery worker consumes (nothing is published to it).
HOLD_QUEUE = "bench.hold"

PLAIN_LINE = len(f"{time.time():.6f} {time.time():.6f}\n")


def _epoch(value: datetime | str) -> float:
    if isinstance(value, str):  # SQLite's raw text, UTC
        value = datetime.fromisoformat(value)
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return value.timestamp()


class System:
    name: str
    label: str
    #: The PostgreSQL database whose transaction counters are this system's (None: none).
    db: str | None = None
    #: How many statements the bench itself ran in that database (completion polls).
    polls = 0
    #: Whether worker_args(hold=True) and release() are supported (Celery workers).
    holdable = False
    #: The Celery node name of the worker (holdable systems).
    node = ""

    def env(self, broker: str, out: Path) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "BENCH_BROKER": broker,
                "BENCH_OUT": str(out),
                "BENCH_DB": self.db or "",
                "PYTHONPATH": str(harness.ROOT),
                "PYTHONUNBUFFERED": "1",
            }
        )
        return env

    def worker_args(self, hold: bool = False) -> list[str]:
        raise NotImplementedError

    def release(self) -> None:
        """Make a held worker consume the jobs' queue (holdable systems)."""
        app = self.app  # type: ignore[attr-defined]
        replies = app.control.add_consumer("celery", destination=[self.node], reply=True, timeout=10)
        if not any(self.node in r and "ok" in r[self.node] for r in replies or []):
            raise RuntimeError(f"{self.node} did not start consuming: {replies!r}")

    def bench_backend_pids(self) -> set[int]:
        """PostgreSQL backends that are the bench's own (completion polls), not the system's."""
        return set()

    def diagnose(self) -> str:
        """A line on where the jobs are, for a cell that timed out."""
        return ""

    def rescue(self) -> int:
        """Jobs stalled (see run.wait_completed): make them runnable again; how many."""
        return 0

    def reset(self, out: Path) -> None:
        """Empty the job tables between cells (no worker running)."""

    def submit_one(self, body: str) -> None:
        raise NotImplementedError

    def submit_batch(self, body: str, n: int, chunk: int) -> None:
        raise NotImplementedError

    def completed(self, out: Path) -> int:
        raise NotImplementedError

    def records(self, out: Path) -> list[tuple[float, float]]:
        raise NotImplementedError

    def close(self) -> None:
        """Close the bench's own connections (so the database's counters are flushed)."""


class _SqlPolling(System):
    """Completion counts and timings read with SQL from the bench process."""

    count_sql: str
    times_sql: str

    def __init__(self) -> None:
        self._engine: sa.Engine | None = None

    @property
    def engine(self) -> sa.Engine:
        if self._engine is None:
            self._engine = sa.create_engine(self.read_url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
            self._conn = self._engine.connect()
        return self._engine

    def _scalar(self, sql: str):
        self.engine  # noqa: B018 (opens the connection on first use)
        self.polls += 1
        return self._conn.exec_driver_sql(sql).scalar_one()

    def completed(self, out: Path) -> int:
        return self._scalar(self.count_sql)

    def bench_backend_pids(self) -> set[int]:
        if self.db is None:
            return set()
        return {self._scalar("SELECT pg_backend_pid()")}

    def records(self, out: Path) -> list[tuple[float, float]]:
        self.engine  # noqa: B018 (opens the connection on first use)
        self.polls += 1
        return [(_epoch(s), _epoch(e)) for s, e in self._conn.exec_driver_sql(self.times_sql)]

    def close(self) -> None:
        if self._engine is not None:
            self._conn.close()
            self._engine.dispose()
            self._engine = None


def _celery_worker(module: str, node: str, hold: bool) -> list[str]:
    return [harness.celery(), "-A", module, *CELERY_WORKER, "-n", node, *(["-Q", HOLD_QUEUE] if hold else [])]


class PlainCelery(System):
    name, label = "celery", "plain Celery"
    holdable, node = True, "plain@bench"

    def __init__(self, broker: str) -> None:
        from bench.apps.celery_plain import make_app

        self.app, self.tasks = make_app(broker)

    def worker_args(self, hold: bool = False) -> list[str]:
        return _celery_worker("bench.apps.celery_plain", self.node, hold)

    def reset(self, out: Path) -> None:
        for path in out.glob("records-*.txt"):
            path.unlink()

    def submit_one(self, body: str) -> None:
        self.tasks[body].delay()

    def submit_batch(self, body: str, n: int, chunk: int) -> None:
        # One producer (one connection and channel) for the whole batch: what
        # group().apply_async does under the hood, without a GroupResult.
        task = self.tasks[body]
        with self.app.producer_or_acquire() as producer:
            for _ in range(n):
                task.apply_async(producer=producer)

    def completed(self, out: Path) -> int:
        return sum(p.stat().st_size for p in out.glob("records-*.txt")) // PLAIN_LINE

    def records(self, out: Path) -> list[tuple[float, float]]:
        rows = []
        for path in out.glob("records-*.txt"):
            for line in path.read_text().splitlines():
                start, end = line.split()
                rows.append((float(start), float(end)))
        return rows


class Lease(_SqlPolling):
    count_sql = "SELECT count(*) FROM celery_lease_jobs WHERE status = 'succeeded'"
    times_sql = "SELECT started_at, finished_at FROM celery_lease_jobs WHERE status = 'succeeded'"
    holdable = True

    def __init__(self, name: str, label: str, db: str, broker: str, postgres: bool, job_options: dict | None = None) -> None:
        super().__init__()
        from bench.apps.lease import make_app

        self.name, self.label, self.node = name, label, f"{name}@bench"
        self.db = db if postgres else None
        self.url = db
        self.read_url = db
        #: Extra ``leases.job(...)`` arguments, the same in this process and the worker.
        self.job_options = job_options or {}
        self.app, self.leases, self.tasks = make_app(db, broker, self.job_options)
        self.leases.create_schema()

    def env(self, broker: str, out: Path) -> dict[str, str]:
        env = super().env(broker, out)
        env["BENCH_DB"] = self.url
        env["BENCH_JOB_OPTIONS"] = json.dumps(self.job_options)
        return env

    def worker_args(self, hold: bool = False) -> list[str]:
        return _celery_worker("bench.apps.lease", self.node, hold)

    def reset(self, out: Path) -> None:
        for path in out.glob("stmts-*.json"):
            path.unlink()
        with self.leases.store.durable.begin() as conn:
            for table in ("celery_lease_events", "celery_lease_jobs", "celery_lease_runs"):
                conn.exec_driver_sql(f"DELETE FROM {table}")

    def submit_one(self, body: str) -> None:
        self.tasks[body].submit({})

    def submit_batch(self, body: str, n: int, chunk: int) -> None:
        task = self.tasks[body]
        for start in range(0, n, chunk):
            task.submit_many([{}] * min(chunk, n - start))

    def rescue(self) -> int:
        # What beat's reaper does: requeue (and wake) jobs whose lease ran out.
        return sum(self.leases.reap().values())

    def diagnose(self) -> str:
        self.engine  # noqa: B018 (opens the connection on first use)
        rows = self._conn.exec_driver_sql(
            "SELECT status, count(*), count(*) FILTER (WHERE lease_owner IS NOT NULL), min(attempt), max(attempt) "
            "FROM celery_lease_jobs GROUP BY status"
        ).all()
        stuck = self._conn.exec_driver_sql(
            "SELECT id, lease_owner, lease_generation, started_at, now() - started_at FROM celery_lease_jobs "
            "WHERE status = 'running' ORDER BY started_at LIMIT 5"
        ).all()
        return (
            "jobs by status (count, with owner, attempts min-max): "
            + "; ".join(f"{st} {n} {owned} {lo}-{hi}" for st, n, owned, lo, hi in rows)
            + "".join(f"\n  running {i} owner {o} generation {g} started {s} ({age} ago)" for i, o, g, s, age in stuck)
        )

    def worker_statements(self, out: Path) -> dict[str, int]:
        total: dict[str, int] = {}
        for path in out.glob("stmts-*.json"):
            for key, count in json.loads(path.read_text()).items():
                total[key] = total.get(key, 0) + count
        return total

    def close(self) -> None:
        super().close()
        self.leases.store.dispose()


class Procrastinate(_SqlPolling):
    name, label = "procrastinate", "procrastinate"
    count_sql = "SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'"
    times_sql = (
        "SELECT s.at, d.at FROM procrastinate_events s JOIN procrastinate_events d "
        "ON d.job_id = s.job_id AND d.type = 'succeeded' WHERE s.type = 'started'"
    )

    def __init__(self, db: str) -> None:
        super().__init__()
        from bench.apps.procrastinate_app import make_app

        self.db = self.read_url = db
        self.app, self.tasks = make_app(db)
        self._open = False
        self._opened().schema_manager.apply_schema()

    def _opened(self):
        if not self._open:
            self.app.open()
            self._open = True
        return self.app

    def worker_args(self, hold: bool = False) -> list[str]:
        return [harness.python(), "-c", "from bench.apps.procrastinate_app import main; main()"]

    def reset(self, out: Path) -> None:
        with self.engine.connect() as conn:
            conn.exec_driver_sql("TRUNCATE procrastinate_events, procrastinate_jobs CASCADE")

    def submit_one(self, body: str) -> None:
        self._opened()
        self.tasks[body].defer()

    def submit_batch(self, body: str, n: int, chunk: int) -> None:
        self._opened()
        task = self.tasks[body]
        for start in range(0, n, chunk):
            task.batch_defer(*[{}] * min(chunk, n - start))

    def close(self) -> None:
        super().close()
        if self._open:
            self.app.close()
            self._open = False


class PgQueuer(_SqlPolling):
    name, label = "pgqueuer", "pgqueuer"
    # pgqueuer deletes a finished job from its queue table and logs each transition.
    count_sql = "SELECT count(*) FROM pgqueuer_log WHERE status = 'successful'"
    times_sql = (
        "SELECT p.created, s.created FROM pgqueuer_log p JOIN pgqueuer_log s "
        "ON s.job_id = p.job_id AND s.status = 'successful' WHERE p.status = 'picked'"
    )

    def __init__(self, db: str) -> None:
        super().__init__()
        self.db = self.read_url = db
        self.loop = asyncio.new_event_loop()
        self._queries = None
        self.loop.run_until_complete(self._install())

    def _dsn(self) -> str:
        from bench.apps.pgqueuer_app import dsn

        return dsn(self.db)

    async def _open(self):
        import asyncpg
        from pgqueuer import AsyncpgDriver
        from pgqueuer.queries import Queries

        if self._queries is None:
            self._conn_pgq = await asyncpg.connect(self._dsn())
            self._queries = Queries(AsyncpgDriver(self._conn_pgq))
        return self._queries

    async def _install(self) -> None:
        q = await self._open()
        await q.install()

    def worker_args(self, hold: bool = False) -> list[str]:
        return [harness.python(), "-m", "bench.apps.pgqueuer_app"]

    def reset(self, out: Path) -> None:
        with self.engine.connect() as conn:
            conn.exec_driver_sql("TRUNCATE pgqueuer, pgqueuer_log, pgqueuer_statistics CASCADE")

    def submit_one(self, body: str) -> None:
        async def go():
            await (await self._open()).enqueue(body, None)

        self.loop.run_until_complete(go())

    def submit_batch(self, body: str, n: int, chunk: int) -> None:
        async def go():
            q = await self._open()
            for start in range(0, n, chunk):
                k = min(chunk, n - start)
                await q.enqueue([body] * k, [None] * k, [0] * k)

        self.loop.run_until_complete(go())

    def close(self) -> None:
        super().close()
        if self._queries is not None:
            self.loop.run_until_complete(self._conn_pgq.close())
            self._queries = None


#: Every system the bench can run: name -> factory(dbs, broker URL, workdir).
FACTORIES = {
    "celery": lambda dbs, broker, workdir: PlainCelery(broker),
    "lease-pg": lambda dbs, broker, workdir: Lease("lease-pg", "celery-lease (PostgreSQL)", dbs.create("lease"), broker, True),
    "lease-sqlite": lambda dbs, broker, workdir: Lease(
        "lease-sqlite", "celery-lease (SQLite)", f"sqlite:///{workdir / 'lease.sqlite3'}", broker, False
    ),
    # A batched kind (batch=100, worker/many_claim.py): one wakeup per 100 jobs, each claim
    # and each completion one statement for up to 100 of them.
    "lease-batch": lambda dbs, broker, workdir: Lease(
        "lease-batch", "celery-lease (PostgreSQL, batch=100)", dbs.create("batch"), broker, True, job_options={"batch": 100}
    ),
    "procrastinate": lambda dbs, broker, workdir: Procrastinate(dbs.create("procrastinate")),
    "pgqueuer": lambda dbs, broker, workdir: PgQueuer(dbs.create("pgqueuer")),
    # Flow control's cost end to end: the same no-op jobs behind a concurrency limit
    # (2, the worker's concurrency: it holds but does not throttle). Not in the default run.
    "lease-pg-limited": lambda dbs, broker, workdir: Lease(
        "lease-pg-limited",
        "celery-lease (PostgreSQL, concurrency=2)",
        dbs.create("limited"),
        broker,
        True,
        job_options={"concurrency": 2},
    ),
}

#: The default run, plain Celery first (every ratio is to it).
SYSTEMS = ["celery", "lease-pg", "lease-batch", "lease-sqlite", "procrastinate", "pgqueuer"]


def check(names: list[str]) -> None:
    """Refuse an unknown system before any service starts."""
    for name in names:
        if name not in FACTORIES:
            raise SystemExit(f"unknown system {name!r} (known: {', '.join(FACTORIES)})")


def make_systems(names: list[str], dbs: harness.Databases, broker: str, workdir: Path) -> list[System]:
    check(names)
    return [FACTORIES[name](dbs, broker, workdir) for name in names]
