"""The bench's private services and worker processes.

A throwaway PostgreSQL database per system per run (created here, dropped at exit), a
private redis-server on a free port (tests.harness.services.RedisServer), and worker processes
whose resident memory (main process plus children) is sampled while they live.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import psutil
import sqlalchemy as sa

from tests.harness.services import RedisServer, wait_for

ROOT = Path(__file__).resolve().parent.parent
PG_ADMIN = os.environ.get("CL_TEST_PG_ADMIN", "postgresql+psycopg2://root@127.0.0.1:5432/postgres")

__all__ = ["Databases", "RedisServer", "WorkerProcess", "wait_for", "ROOT"]


class Databases:
    """Creates throwaway databases and drops them all at close; reads their counters."""

    def __init__(self) -> None:
        self.admin = sa.create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
        self.tag = f"bench_{os.getpid()}_{uuid.uuid4().hex[:6]}"
        self.names: list[str] = []

    def create(self, suffix: str) -> str:
        name = f"{self.tag}_{suffix}"
        with self.admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
        self.names.append(name)
        return sa.engine.make_url(PG_ADMIN).set(database=name).render_as_string(hide_password=False)

    def transactions(self, url: str) -> int:
        """Committed plus rolled-back transactions of the database so far.

        Backends publish their counters when they exit (and at most once a second
        while they run), so call :meth:`quiesce` first for an exact figure.
        """
        name = sa.engine.make_url(url).database
        with self.admin.connect() as conn:
            return conn.exec_driver_sql(
                "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s", (name,)
            ).scalar_one()

    def quiesce(self, url: str, timeout: float = 15.0) -> None:
        """Wait until no session is connected to the database (all counters flushed)."""
        name = sa.engine.make_url(url).database

        def idle():
            with self.admin.connect() as conn:
                return conn.exec_driver_sql("SELECT count(*) FROM pg_stat_activity WHERE datname = %s", (name,)).scalar_one() == 0

        wait_for(idle, timeout=timeout, what=f"sessions on {name} to close")

    def close(self) -> None:
        with self.admin.connect() as conn:
            for name in self.names:
                conn.exec_driver_sql(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
                    (name,),
                )
                conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}"')
        self.admin.dispose()


class WorkerProcess:
    """One worker (any system) in its own session; its peak RSS is sampled every 50 ms.

    RSS of forked pool children counts their copy-on-write pages shared with the
    parent once per process, as `ps` does; plain Celery is measured the same way.
    PSS (proportional set size: a page shared by k processes counts 1/k in each) is
    sampled too, every 0.5 s (reading smaps costs more): what the worker adds to the
    machine's memory, shared libraries and copy-on-write pages counted once.
    """

    def __init__(self, args: list[str], env: dict[str, str], out: Path) -> None:
        self.args = args
        self.env = env
        self.out = out
        self.log_path = out / "worker.log"
        self.proc: subprocess.Popen | None = None
        self.peak_rss = 0
        self.peak_pss = 0
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None

    def start(self, timeout: float = 60.0) -> WorkerProcess:
        (self.out / "ready").unlink(missing_ok=True)
        self._log = open(self.log_path, "a")
        self.proc = subprocess.Popen(
            self.args, env=self.env, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self._stop.clear()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()
        wait_for(
            lambda: (self.out / "ready").exists() or self.proc.poll() is not None, timeout=timeout, what="worker to be ready"
        )
        if self.proc.poll() is not None:
            raise RuntimeError(f"worker exited at start:\n{self.log_path.read_text()[-3000:]}")
        return self

    def children(self) -> list[int]:
        try:
            return [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def _sample(self) -> None:
        try:
            main = psutil.Process(self.proc.pid)
        except psutil.NoSuchProcess:
            return
        ticks = 0
        while not self._stop.is_set():
            pss = ticks % 10 == 0
            ticks += 1
            try:
                processes = [main, *main.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            rss_total = pss_total = 0
            for process in processes:
                try:
                    rss_total += process.memory_info().rss
                    if pss:
                        pss_total += process.memory_full_info().pss
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
            self.peak_rss = max(self.peak_rss, rss_total)
            self.peak_pss = max(self.peak_pss, pss_total)
            self._stop.wait(0.05)

    def stop(self, timeout: float = 60.0) -> None:
        """Warm shutdown (SIGTERM to the main process); SIGKILL to the group after timeout."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._stop.set()
        if self._sampler is not None:
            self._sampler.join()
        self._log.close()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._stop.set()


def python() -> str:
    return sys.executable


def celery() -> str:
    return str(Path(sys.executable).with_name("celery"))
