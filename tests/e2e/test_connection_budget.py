"""The connection budget of docs/operations.md ("Running at scale"), measured.

Real workers (prefork, threads, gevent), beat and the API server run a mixed workload
(checkpointing and cancelled jobs, a limited, a rated and a batched kind, beat's reap and
sweep ticks, API reads) against PostgreSQL directly. Every process's connections are
sampled while it runs: the sockets each process holds to the server (psutil), matched
with the server's own view (pg_stat_activity's client_port on the run's database). The
test asserts the budget the docs give, so the docs stay true; its figures are printed
in the terminal summary.
"""

from __future__ import annotations

import threading
import time

import httpx
import psutil
import pytest
import sqlalchemy as sa

from tests.conftest import SUMMARY_LINES, wait_for
from tests.e2e import test_flow
from tests.e2e.test_pgbouncer import BEAT, MODULE, TOKEN, rows, wait_ended
from tests.e2e.test_pgbouncer import api as api_fixture

#: The budget docs/operations.md gives: the most connections one process can hold. A
#: pool never holds more connections than were checked out of it at once (a pinned one
#: is one per thread), so the bound is, per engine (durable and fast, each transactional
#: and single-statement), the threads that use it, plus the heartbeat's own connection.
ENGINES = 4
#: A prefork pool child: its handler thread and the completer thread (4 to 7 measured).
PREFORK_CHILD = ENGINES * 2 + 1
#: A prefork worker's main process: maintenance ticks, restart recovery, revokes (0 or 1 measured).
PREFORK_MAIN = 2
#: Beat only publishes its ticks; a worker's main process runs them.
BEAT_PROCESS = 0
#: The API server's pool (DEFAULT_POOL_SIZE + DEFAULT_MAX_OVERFLOW): 1 at this load.
API_PROCESS = 12
#: A gevent worker: its engines pin nothing and hold at most GREEN_POOL_SIZE each
#: (10 to 15 measured at -c 20).
GREEN_PROCESS = ENGINES * 12 + 1


def threads_process(concurrency: int) -> int:
    """A threads worker: its handler threads, the completer and the main process's
    maintenance on each engine (8 to 13 measured at -c 4)."""
    return ENGINES * (concurrency + 2) + 1


db = test_flow.db
api = api_fixture


class Sampler:
    """Samples, every 0.2 s, how many connections each process of ``roots`` (and its
    children) holds to the server, as pg_stat_activity sees them on ``database``."""

    def __init__(self, pg_url: str, roots: dict[str, int]) -> None:
        url = sa.engine.make_url(pg_url)
        self.port = url.port or 5432
        self.database = url.database
        self.engine = sa.create_engine(pg_url, poolclass=sa.pool.NullPool)
        self.roots = roots
        self.peak: dict[str, int] = {}
        self.last: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.engine.dispose()

    def processes(self) -> dict[str, psutil.Process]:
        found = {}
        for name, pid in self.roots.items():
            try:
                root = psutil.Process(pid)
                found[name] = root
                for i, child in enumerate(sorted(root.children(), key=lambda p: p.pid)):
                    found[f"{name}/child{i}"] = child
            except psutil.NoSuchProcess:
                pass
        return found

    def sample(self) -> dict[str, int]:
        ports: dict[int, str] = {}
        for name, proc in self.processes().items():
            try:
                for c in proc.net_connections(kind="tcp"):
                    if c.raddr and c.raddr.port == self.port and c.status == psutil.CONN_ESTABLISHED:
                        ports[c.laddr.port] = name
            except psutil.NoSuchProcess:
                pass
        with self.engine.connect() as conn:
            seen = conn.execute(
                sa.text("SELECT client_port FROM pg_stat_activity WHERE datname = :db AND client_port = ANY(:ports)"),
                {"db": self.database, "ports": list(ports)},
            ).scalars()
            counts: dict[str, int] = {name: 0 for name in self.processes()}
            for port in seen:
                counts[ports[port]] += 1
        return counts

    def _run(self) -> None:
        while not self._stop.is_set():
            self.last = self.sample()
            for name, n in self.last.items():
                self.peak[name] = max(self.peak.get(name, 0), n)
            self._stop.wait(0.2)


@pytest.mark.parametrize("prepared", [pytest.param(True, id="prepared"), pytest.param(False, id="unprepared")])
def test_connections_per_process_stay_within_the_documented_budget(
    pg, broker, client_app, workers, beats, api, db, request, prepared
):
    conf = {"lease_prepare_statements": prepared}
    mod = client_app(pg, broker, conf=conf, module=MODULE)
    fleet = {
        "prefork": workers(pg, broker, name="prefork", module=MODULE, concurrency=2, conf=conf),
        "threads": workers(pg, broker, name="threads", module=MODULE, concurrency=4, pool="threads", conf=conf),
        "gevent": workers(pg, broker, name="gevent", module=MODULE, concurrency=20, pool="gevent", conf=conf),
    }
    beat = beats(pg, broker, conf={**conf, **BEAT}, module=MODULE)
    base, api_pid = api(pg, broker, conf)
    roots = {name: w.pid for name, w in fleet.items()} | {"beat": beat.proc.pid, "api": api_pid}
    with Sampler(pg, roots) as sampler:
        ids = [j.id for j in mod.steps.submit_many([{"steps": 8, "sleep": 0.1}] * 9)]
        ids += [j.id for j in mod.limited2.submit_many([{"sleep": 0.2}] * 6)]
        ids += [j.id for j in mod.rated.submit_many([{}] * 6)]
        ids += [j.id for j in mod.b_note.submit_many([{"n": n} for n in range(12)])]
        ids += [j.id for j in mod.echo.submit_many([{"value": n} for n in range(30)])]
        cancelled = wait_for(
            lambda: next((i for i, r in rows(db, ids[:9]).items() if r["status"] == "running"), None),
            timeout=30,
            interval=0.05,
            what="a running job",
        )
        mod.leases.cancel(cancelled)
        headers = {"Authorization": f"Bearer {TOKEN}"}
        for job_id in ids[:20]:
            httpx.get(f"{base}/api/v1/jobs/{job_id}", headers=headers, timeout=10).raise_for_status()
        httpx.get(f"{base}/api/v1/jobs", params={"limit": 50}, headers=headers, timeout=10).raise_for_status()
        wait_ended(db, ids, timeout=60)
        time.sleep(3)  # beat's ticks run on the workers' main processes meanwhile
    peak = sampler.peak

    def most(prefix: str) -> int:
        return max((n for name, n in peak.items() if name.startswith(prefix)), default=0)

    children = {name: n for name, n in peak.items() if name.startswith("prefork/")}
    line = (
        f"connection budget (peak per process, prepared={prepared}): "
        + ", ".join(f"{name}={n}" for name, n in sorted(peak.items()))
        + f"; prefork -c 2 worker total={peak['prefork'] + sum(children.values())}"
    )
    request.config.stash.setdefault(SUMMARY_LINES, []).append(line)
    print(line)
    assert len(children) == 2 and all(n >= 1 for n in children.values()), peak
    assert most("prefork/") <= PREFORK_CHILD, peak
    assert peak["prefork"] <= PREFORK_MAIN, peak
    assert peak["threads"] <= threads_process(4), peak
    assert peak["gevent"] <= GREEN_PROCESS, peak
    assert peak["beat"] == BEAT_PROCESS, peak
    assert 1 <= peak["api"] <= API_PROCESS, peak
