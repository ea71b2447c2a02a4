"""A randomized workload over real workers, through the fault proxy, recorded as a
:class:`tests.harness.history.History`.

The jobs live on a private PostgreSQL cluster (``wal_writer_delay`` raised to 10 s, so a
commit made asynchronously is lost by the crash the run inflicts on it); the workers
and beat reach it through a :class:`tests.harness.pgfaults.PgFaultProxy`; the test
process submits, cancels and revokes directly. The handlers (tests/apps/app_history.py)
record their bodies and fenced writes in a history database on a second private cluster.

Everything random comes from ``Workload.seed``: the mix of jobs, when they are
submitted, which are cancelled or revoked, and the faults (worker and pool-child
SIGKILLs, every connection cut, a statement failing, losing its reply, arriving late or
holding its locks, one backend SIGKILLed (preferably while its COMMIT waits in
``commit_delay``), PostgreSQL crashing once, and once a COMMIT's reply lost with the
workers and beat then cut off for longer than the lease). Timing still varies from run
to run; the seed replays the same plan.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg2
import sqlalchemy as sa

from tests.harness import pgcluster
from tests.harness.chaos import LEASE_CONF, LEASE_QUEUES, Fleet, Scenario
from tests.harness.history import History, Op
from tests.harness.pgfaults import PgFaultProxy
from tests.harness.services import RedisServer, wait_for

MODULE = "tests.apps.app_history"
LEASE = 3

#: What the statement faults aim at: substrings of the product's SQL.
TARGETS = (
    "UPDATE celery_lease_jobs",
    "INSERT INTO celery_lease_jobs",
    "celery_lease_limits",
    "SKIP LOCKED",
    "lease_expires_at",
    "checkpoint",
    "COMMIT",
    "history_effects",
    "celery_lease_events",
)
#: Fault kinds and their relative frequency.
FAULTS = {"kill_worker": 2, "kill_child": 2, "cut_all": 2, "lose_reply": 4, "fail": 2, "hold": 1, "delay": 1, "kill_backend": 1}
#: Items of the mix and their relative frequency.
MIX = {
    "plain": 4,
    "fair": 2,
    "batch": 2,
    "priority": 2,
    "limited": 3,
    "rated": 2,
    "snooze": 2,
    "timeout": 1,
    "errback_fail": 2,
    "errback_ok": 1,
    "chain": 1,
    "group": 1,
    "chord": 1,
    "chord_fail": 1,
}


@dataclass
class Workload:
    seed: int
    items: int = 40  # a canvas item makes several jobs
    seconds: float = 12.0  # submits and faults happen for this long
    drain_seconds: float = 90.0
    workers: int = 2
    concurrency: int = 2
    pool: str = "prefork"
    prepared: bool = True
    fault_every: float = 0.8
    pg_crash_at: float | None = 6.0
    #: When a batched claim's COMMIT reply is lost and PostgreSQL restarts before the
    #: Landing can ask whether it landed (#27 item 2): armed once, for the first batch
    #: submitted after this second. In the default runs too (3 s in), since seed
    #: 594013 (a limited claim's attempt lost to the restart's outage) replays clean.
    batch_restart_at: float | None = None
    #: When a COMMIT's reply is lost and the workers and beat are cut off from the
    #: database for longer than the lease (the proxy pauses), once per run.
    partition_at: float | None = 1.5
    cancel_share: float = 0.08
    revoke_share: float = 0.04

    def conf(self) -> dict:
        return {**LEASE_CONF, "lease_prepare_statements": self.prepared}


# --- databases --------------------------------------------------------------------------


@contextmanager
def databases() -> Iterator[tuple[pgcluster.PrivateCluster, str, str]]:
    """(cluster, jobs URL on it, history URL), migrated. The history lives on a second
    private cluster: its commits must not flush the jobs' WAL, it must survive the jobs'
    crash, and the run must not depend on the shared server's connection slots."""
    from celery_lease.db import migrate
    from celery_lease.db.store import Store
    from tests.apps.app import test_metadata
    from tests.apps.history_tables import effect_metadata, history_metadata

    # A commit made with synchronous_commit=off reaches the disk only when the WAL
    # writer wakes (every 10 s here) or a synchronous commit flushes past it.
    # Every durable commit waits 20 ms before its flush (commit_delay, with no sibling
    # needed): a backend killed (kill_backend) is then often one whose COMMIT waits.
    settings = {"wal_writer_delay": "10s", "wal_writer_flush_after": 0, "commit_delay": 20000, "commit_siblings": 0}
    with (
        pgcluster.private_cluster(max_connections=200, settings=settings) as cluster,
        pgcluster.private_cluster(settings={"synchronous_commit": "off", "fsync": "off"}) as recorder,
    ):
        url = cluster.create_database("jobs")
        store = Store(url)
        migrate.upgrade(store)
        test_metadata.create_all(store.durable)
        effect_metadata.create_all(store.durable)
        store.dispose()
        history_url = recorder.create_database("history")
        engine = sa.create_engine(history_url)
        history_metadata.create_all(engine)
        engine.dispose()
        yield cluster, url, history_url


def worker_env(history_url: str) -> dict[str, str]:
    return {"CL_TEST_LEASE": str(LEASE), "CL_HISTORY_DB": history_url}


# --- the run ------------------------------------------------------------------------------


class Run:
    def __init__(self, w: Workload, *, mod: Any, cluster, jobs_url: str, history_url: str, redis: RedisServer, workdir: Path):
        self.w, self.mod, self.cluster = w, mod, cluster
        self.jobs_url, self.history_url = jobs_url, history_url
        self.proxy = PgFaultProxy(cluster.host, cluster.port).start()
        scenario = Scenario(workers=w.workers, concurrency=w.concurrency, pool=w.pool)
        self.fleet = Fleet(
            self.proxy.url_for(jobs_url),
            redis,
            workdir,
            scenario,
            module=MODULE,
            conf=w.conf(),
            extra_env=worker_env(history_url),
            queues=LEASE_QUEUES,
            with_beat=True,
        )
        self.ops: list[Op] = []
        self._lock = threading.Lock()
        self.node_kills: dict[str, list[float]] = defaultdict(list)
        #: Each process's first SIGKILL: it died then. (A later kill of the same pid, e.g.
        #: its worker's, read from a stale child list, must not move it: the checker
        #: excuses a claim by when its process died.)
        self.pid_kills: dict[int, float] = {}
        self.run_id = str(uuid.uuid4())
        self.submitted: list[str] = []
        self._restarting: set[int] = set()
        #: Held across the crash: the client's one non-idempotent call (a chord) waits.
        self._client_lock = threading.Lock()
        #: Set when the batched claim's lost reply and restart is due (Workload.batch_restart_at).
        self._batch_restart_due = threading.Event()
        self._restarts: list[threading.Thread] = []

    def op(self, op: str, job_id: str | None = None, **detail) -> None:
        with self._lock:
            self.ops.append(Op(time.time(), op, job_id, detail))

    def execute(self) -> History:
        try:
            self.fleet.start()
            failed: list[BaseException] = []

            def submit_all() -> None:
                try:
                    self._submit_all()
                except BaseException as exc:
                    failed.append(exc)

            submitter = threading.Thread(target=submit_all, name="history-submit", daemon=True)
            submitter.start()
            self._faults()
            self.proxy.clear()
            for thread in self._restarts:
                thread.join(timeout=60)
            self.proxy.resume()  # whatever a partition's thread did
            submitter.join(timeout=120)
            if failed:
                raise failed[0]
            self._drain()
            return self._read()
        finally:
            self.fleet.stop()
            self.proxy.close()

    # --- operations ---------------------------------------------------------------------

    def _retry(self, what: str, fn: Callable[[], Any]) -> Any:
        """Client calls ride out the crash: same idempotency key or frozen id each time."""
        deadline = time.monotonic() + 60
        while True:
            try:
                return fn()
            except Exception as exc:  # the client is not under test; its retries are
                if time.monotonic() > deadline:
                    raise AssertionError(f"{what} kept failing: {exc!r}") from exc
                time.sleep(0.5)

    def _submit_all(self) -> None:
        rng = random.Random(self.w.seed)
        kinds, weights = zip(*MIX.items())
        gap = self.w.seconds * 0.8 / max(1, self.w.items)
        for n in range(self.w.items):
            time.sleep(rng.uniform(0, 2 * gap))
            item = rng.choices(kinds, weights)[0]
            if n == 0:
                item = "batch"  # every run has jobs of the batched kind (worker/many_claim.py)
            self._submit(rng, n, item)
            if self.submitted and rng.random() < self.w.cancel_share:
                target = rng.choice(self.submitted)
                returned = self._retry("cancel", lambda t=target: self.mod.leases.cancel(t))
                self.op("cancel", target, returned=returned)
            if self.submitted and rng.random() < self.w.revoke_share:
                target = rng.choice(self.submitted)
                self._retry("revoke", lambda t=target: self.mod.app.control.revoke(t))
                self.op("revoke", target)

    def _steps(self, rng: random.Random, **extra) -> dict:
        return {"steps": rng.randint(1, 3), "sleep": rng.choice((0.05, 0.1, 0.2, 0.3)), **extra}

    def _record_submit(self, job_id: str, item: str) -> None:
        self.op("submit", job_id, item=item)
        self.submitted.append(job_id)

    def _submit(self, rng: random.Random, n: int, item: str) -> None:
        from celery import chain, chord, group

        m = self.mod
        key = f"history-{self.w.seed}-{n}"
        simple = {
            "plain": (m.h_plain, self._steps(rng), None),
            "priority": (m.h_plain, self._steps(rng), rng.randint(1, 9)),
            "limited": (m.h_limited, self._steps(rng), None),
            "rated": (m.h_rated, self._steps(rng, steps=1, sleep=0.02), None),
            "snooze": (m.h_snooze, {"times": rng.randint(1, 3), "delay": rng.choice((0.0, 0.2, 0.5))}, None),
            "timeout": (m.h_timeout, {"seconds": 2.0, "cooperative": rng.random() < 0.5}, None),
            "fair": (m.h_fair, self._steps(rng), rng.choice((None, 0, 3))),
        }
        if item in simple:
            task, payload, priority = simple[item]
            tenant = rng.choice(("t1", "t2", "t3", None)) if item == "fair" else None
            job = self._retry(
                f"submit {item}",
                lambda: task.submit(payload, idempotency_key=key, run_id=self.run_id, priority=priority, tenant=tenant),
            )
            self._record_submit(job.id, item)
        elif item == "batch":  # several at once: one wakeup per four, claimed and completed together
            if self._batch_restart_due.is_set():
                self._batch_restart_due.clear()
                self._batch_reply_then_restart()
            payloads = [self._steps(rng, steps=1, sleep=0.05) for _ in range(rng.randint(2, 6))]
            keys = [f"{key}-{i}" for i in range(len(payloads))]
            batch = self._retry("submit batch", lambda: m.h_batch.submit_many(payloads, idempotency_keys=keys))
            for job in batch:
                self._record_submit(job.id, item)
        elif item in ("errback_fail", "errback_ok"):
            task_id = str(uuid.uuid4())
            payload = self._steps(rng, fail=item == "errback_fail")
            self._retry(
                f"apply {item}",
                lambda: m.h_plain.apply_async((payload,), task_id=task_id, run_id=self.run_id, link_error=[m.h_errback.s()]),
            )
            self._record_submit(task_id, item)
        elif item == "chain":
            # Ids chosen here: applying the same frozen steps again is the same jobs.
            first = str(uuid.uuid4())
            sig = chain(m.h_plain.s(self._steps(rng, n=1)).set(task_id=first), m.h_plain.s(), m.h_plain.s())
            self._retry("apply chain", sig.apply_async)
            self._record_submit(first, item)
        elif item == "group":
            ids = [str(uuid.uuid4()) for _ in range(3)]
            sig = group(m.h_plain.s(self._steps(rng)).set(task_id=i) for i in ids)
            self._retry("apply group", sig.apply_async)
            for member in ids:
                self._record_submit(member, item)
        else:  # chord, chord_fail: the body's errback fires when a header job fails
            ids = [str(uuid.uuid4()) for _ in range(3)]
            payloads = [self._steps(rng, n=i) for i in range(3)]
            if item == "chord_fail":
                payloads[rng.randrange(3)]["fail"] = True
            header = [m.h_plain.s(p).set(task_id=i) for p, i in zip(payloads, ids)]
            body_id = str(uuid.uuid4())
            body = m.h_sum.s().set(task_id=body_id).on_error(m.h_errback.s())
            # Not retried (a second apply would write a second counter): kept out of the crash.
            with self._client_lock:
                chord(header, body).apply_async()
            for member in ids:
                self._record_submit(member, item)
            self.op("chord", body_id, header=ids)

    # --- faults --------------------------------------------------------------------------

    def _faults(self) -> None:
        rng = random.Random(self.w.seed + 1)
        kinds, weights = zip(*FAULTS.items())
        started = time.monotonic()
        crash_at = None if self.w.pg_crash_at is None else started + self.w.pg_crash_at
        restart_at = None if self.w.batch_restart_at is None else started + self.w.batch_restart_at
        partition_at = None if self.w.partition_at is None else started + self.w.partition_at
        while time.monotonic() - started < self.w.seconds:
            time.sleep(rng.uniform(0.5, 1.5) * self.w.fault_every)
            if restart_at is not None and time.monotonic() >= restart_at:
                restart_at = None
                self._batch_restart_due.set()  # armed by the next batch's submit
                continue
            if crash_at is not None and time.monotonic() >= crash_at:
                crash_at = None
                with self._client_lock:
                    self.op("fault", fault="pg_crash")
                    self.cluster.crash()
                    time.sleep(0.5)
                    self.cluster.start()
                continue
            if partition_at is not None and time.monotonic() >= partition_at:
                partition_at = None
                self._partition_after_lost_reply()
            kind = rng.choices(kinds, weights)[0]
            target = rng.choice(TARGETS)
            if kind == "kill_worker":
                self._kill_worker(rng.randrange(len(self.fleet.workers)))
            elif kind == "kill_child":
                self._kill_child(rng)
            elif kind == "kill_backend":
                self._kill_backend()
            elif kind == "cut_all":
                self.op("fault", fault="cut_all", sockets=self.proxy.cut_all())
            elif kind == "lose_reply":
                self.proxy.lose_reply(target)
            elif kind == "fail":
                self.proxy.fail(target, error=rng.choice((None, "40001", "57014")))
            elif kind == "hold":
                self.proxy.hold(target, 2.0)
            else:
                self.proxy.delay(target, 1.0)
            if kind in ("lose_reply", "fail", "hold", "delay"):
                self.op("armed", fault=kind, match=target)

    def _batch_reply_then_restart(self) -> None:
        """The reply to a batched claim's COMMIT is lost, the Landing's question of
        whether it landed is held up, and PostgreSQL restarts meanwhile: the question is
        void and the claim runs again (it must adopt its first rows, not claim others).
        In the background: the next faults do not wait for it."""
        # (Every Landing's question while armed: one of them is the claim's.)
        question = self.proxy.delay("DO NOTHING RETURNING token", 2.0, times=None)  # landing.settle_mark
        lost = self.proxy.lose_reply("next_id")  # (only claim_many returns next_id)
        self.op("armed", fault="batch_reply_restart", match="next_id")

        def restart() -> None:
            try:
                if lost.wait(timeout=10.0):
                    with self._client_lock:
                        self.op("fault", fault="pg_restart")
                        self.cluster.restart()
            finally:
                self.proxy.remove(lost)
                self.proxy.remove(question)

        thread = threading.Thread(target=restart, name="history-batch-restart", daemon=True)
        thread.start()
        # Joined before the drain, like every restart: the drain and the checker's reads
        # need the server up.
        self._restarts.append(thread)

    def _kill_backend(self) -> None:
        """SIGKILL one server process (the OOM killer, a segfault): one whose COMMIT waits
        if any, else one in a transaction that wrote, else any. The postmaster resets
        every backend and replays the WAL without restarting, forgetting the xids whose
        WAL was not flushed. Under the client lock, which the batched claim's restart
        holds from another thread: the server may be restarting, and then no backend is
        killed (the harness's own connection failed the run: "the database system is
        shutting down")."""
        with self._client_lock:
            try:
                conn = self.cluster.connect("jobs")
                try:
                    with conn.cursor() as cur:
                        cur.execute(
                            "SELECT pid, query FROM pg_stat_activity WHERE datname = 'jobs' AND pid <> pg_backend_pid()"
                            " ORDER BY (state = 'active' AND query ILIKE 'COMMIT%') DESC, backend_xid IS NOT NULL DESC LIMIT 1"
                        )
                        row = cur.fetchone()
                finally:
                    conn.close()
            except psycopg2.OperationalError:
                return
            if row is None:
                return
            self.op("fault", fault="kill_backend", pid=row[0], query=row[1][:60])
            self.cluster.kill_backend(row[0])

    def _partition_after_lost_reply(self) -> None:
        """The next COMMIT's reply is lost, and the proxy pauses at that moment for longer
        than the lease: nobody behind it can ask what became of the commit."""
        rule = self.proxy.lose_reply("COMMIT", then_pause=True)
        self.op("armed", fault="lose_reply+partition", match="COMMIT")

        def partition() -> None:
            rule.wait(10.0)
            self.proxy.remove(rule)  # a connection it armed still loses its reply
            wait_for(lambda: rule.pending == 0, timeout=10, interval=0.05, what="an armed lost reply to end")
            if rule.hits:
                self.op("fault", fault="partition", seconds=LEASE + 1.0)
                time.sleep(LEASE + 1.0)
                self.proxy.resume()

        thread = threading.Thread(target=partition, name="history-partition", daemon=True)
        thread.start()
        self._restarts.append(thread)

    def _kill_worker(self, index: int) -> None:
        """SIGKILL a worker (its pool too) and boot it again under the same name, in the
        background: the next faults do not wait for it to be ready."""
        if index in self._restarting:
            return
        worker = self.fleet.workers[index]
        pids = [worker.pid, *worker.children()]
        now = time.time()
        self.node_kills[f"{worker.name}@testhost"].append(now)
        for pid in pids:
            self.pid_kills.setdefault(pid, now)
        self.fleet.kill(index)
        self.op("fault", fault="kill_worker", node=worker.name, pids=pids)
        self._restarting.add(index)

        def restart() -> None:
            # A worker refuses to boot while PostgreSQL is down (the crash): try again.
            try:
                deadline = time.monotonic() + 90
                while True:
                    time.sleep(0.5)
                    try:
                        self.fleet.workers[index] = self.fleet._worker(worker.name)
                        return
                    except AssertionError:
                        if time.monotonic() > deadline:
                            raise
            finally:
                self._restarting.discard(index)

        thread = threading.Thread(target=restart, name=f"history-restart-{index}", daemon=True)
        thread.start()
        self._restarts.append(thread)

    def _kill_child(self, rng: random.Random) -> None:
        if self.w.pool != "prefork":
            return self._kill_worker(rng.randrange(len(self.fleet.workers)))
        index = rng.randrange(len(self.fleet.workers))
        if index in self._restarting:
            return None
        children = self.fleet.workers[index].children()
        if not children:
            return None
        pid = rng.choice(children)
        self.pid_kills.setdefault(pid, time.time())
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return None
        self.op("fault", fault="kill_child", pid=pid)
        return None

    # --- the end ---------------------------------------------------------------------------

    def _drain(self) -> None:
        from celery_lease.db.schema import jobs

        engine = sa.create_engine(self.jobs_url, poolclass=sa.pool.NullPool)
        quiet = [0]

        def settled() -> bool:
            try:
                with engine.connect() as conn:
                    left = conn.execute(sa.select(sa.func.count()).where(jobs.c.status.in_(["pending", "running"]))).scalar()
            except sa.exc.OperationalError:
                # A restart fault's server still coming back (a fresh-clone run failed here
                # with "the database system is shutting down"): not settled yet.
                left = None
            quiet[0] = quiet[0] + 1 if left == 0 else 0
            return quiet[0] >= 3  # a chain's next step or an errback may still be on its way

        try:
            wait_for(settled, timeout=self.w.drain_seconds, interval=1.0, what="the jobs to settle")
        except AssertionError:
            pass  # the checker reports what did not end
        finally:
            engine.dispose()

    def _read(self) -> History:
        for e in list(self.proxy.events):
            self.ops.append(Op(e.at, "fault", None, {"fault": e.fault, "match": e.match, "statement": e.statement[:100]}))
        self.ops.sort(key=lambda op: op.at)
        return read_history(
            self.jobs_url,
            self.history_url,
            self.ops,
            concurrency={"h_limited": 2, "h_timeout": 2},
            rates={"h_rated": (5, 1)},
            effect_kinds=frozenset({"h_plain", "h_fair", "h_limited", "h_rated", "h_snooze", "h_timeout", "h_sum", "h_errback"}),
            node_kills=dict(self.node_kills),
            pid_kills=dict(self.pid_kills),
            ended_workers=self.fleet.exits(restarting=self._restarting),
        )


def read_history(jobs_url: str, history_url: str, ops: list[Op], **kinds: Any) -> History:
    """Read back a run: the job rows, run events and effects of the jobs' database, the
    bodies and fenced writes of the history database. ``kinds``: the History's fields
    that describe the workload (concurrency, rates, effect_kinds, node_kills, pid_kills,
    ended_workers)."""
    from celery_lease.db.schema import events, jobs
    from tests.apps.history_tables import bodies, effects, writes

    def epoch(value):
        return value.timestamp() if value is not None else None

    engine = sa.create_engine(jobs_url, poolclass=sa.pool.NullPool)
    with engine.connect() as conn:
        cols = [jobs.c[c] for c in ("id", "kind", "status", "attempt", "lease_generation", "error", "parent_id")]
        cols += [jobs.c.canvas, jobs.c.payload, jobs.c.created_at, jobs.c.finished_at]
        job_rows = {}
        for r in conn.execute(sa.select(*cols)).mappings():
            row = dict(r)
            row["id"], row["parent_id"] = str(row["id"]), row["parent_id"] and str(row["parent_id"])
            row["created_at"], row["finished_at"] = epoch(row["created_at"]), epoch(row["finished_at"])
            job_rows[row["id"]] = row
        event_rows = [
            {"job_id": str(r.job_id), "event": r.event, "attempt": r.attempt, "detail": r.detail, "at": epoch(r.created_at)}
            for r in conn.execute(sa.select(events).order_by(events.c.id))
        ]
        effect_rows = [dict(r) for r in conn.execute(sa.select(effects)).mappings()]
    engine.dispose()
    engine = sa.create_engine(history_url, poolclass=sa.pool.NullPool)
    with engine.connect() as conn:
        body_rows = [dict(r) for r in conn.execute(sa.select(bodies).order_by(bodies.c.id)).mappings()]
        write_rows = [dict(r) for r in conn.execute(sa.select(writes).order_by(writes.c.id)).mappings()]
    engine.dispose()
    return History(ops=ops, jobs=job_rows, events=event_rows, bodies=body_rows, writes=write_rows, effects=effect_rows, **kinds)
