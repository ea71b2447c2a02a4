"""The chaos scenario: hundreds of jobs, real workers and beat, faults on a schedule.

Shared by the test (tests/e2e/test_chaos.py, celery-lease) and the comparison
(bench/chaos_plain_celery.py, plain Celery with acks_late): both run the same jobs —
most short, every ``long_every``-th one outliving several leases and a short Redis
visibility timeout — and the same :class:`FaultInjector`, and report the same line::

    jobs=300 succeeded=297 expired=3 failed=0 lost=0 duplicate_effects=0 faults=20 (...)

``lost`` counts jobs that never reached a terminal status, plus succeeded jobs without
their effect row; ``duplicate_effects`` counts jobs whose effect was committed more than
once. Expired and failed jobs are not lost: their row says what happened to them.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import sqlalchemy as sa

from tests.conftest import Beat, RedisServer, Worker, throwaway_database, wait_for

FAULTS = ("kill_worker", "kill_child", "restart_redis", "terminate_pg")
#: Relative frequency of each fault kind.
WEIGHTS = (3, 3, 1, 3)


@dataclass
class Scenario:
    jobs: int = 300
    seconds: float = 50.0  # faults are injected for this long
    drain_seconds: float = 90.0  # then everything must settle within this long
    fault_every: float = 2.5
    workers: int = 2
    concurrency: int = 2
    lease: int = 3
    long_every: int = 25  # every n-th job runs ~8 s: several leases, most of a visibility timeout
    seed: int = 7
    # --- production configurations (issue #9) ---
    pool: str = "prefork"
    #: every other job is of a kind with a lease of ``long_lease`` s, in the same workers
    mixed_leases: bool = False
    long_lease: int = 30
    #: beat's wall clock is this far off (libfaketime), e.g. "-6s" or "+5m"
    beat_skew: str | None = None
    #: PostgreSQL (a PrivateCluster) crashes this many seconds into the faults, once
    pg_crash_at: float | None = None
    #: attempts per job: high enough that no job may run out of them under the faults
    attempts: int = 20
    #: inject these fault kinds in turn instead of drawing them (a short run then sees
    #: each one); e.g. ("kill_worker", "restart_broker", "terminate_pg")
    fault_cycle: tuple[str, ...] | None = None
    #: Workers run as teams deploy them: Celery's default bootsteps (mingle, gossip,
    #: heartbeat) and task events (-E). A Celery 5.7 worker so run could exit at a Redis
    #: restart (worker/broker_restart.py); without them the fleet would never see it.
    as_deployed: bool = True

    @classmethod
    def from_env(cls, **defaults) -> Scenario:
        """CHAOS_SECONDS / CHAOS_JOBS / CHAOS_SEED override the defaults."""
        s = cls(**defaults)
        if os.environ.get("CHAOS_SECONDS"):
            s.seconds = float(os.environ["CHAOS_SECONDS"])
            s.drain_seconds = max(s.drain_seconds, s.seconds / 2)
        if os.environ.get("CHAOS_JOBS"):
            s.jobs = int(os.environ["CHAOS_JOBS"])
        if os.environ.get("CHAOS_SEED"):
            s.seed = int(os.environ["CHAOS_SEED"])
        return s

    def payloads(self) -> list[dict]:
        """The jobs' payloads; with ``mixed_leases``, every other one says
        ``"lease": "long"`` (submit it as chaos_long)."""
        rng = random.Random(self.seed)
        out = []
        for n in range(self.jobs):
            if self.long_every and n % self.long_every == self.long_every - 1:
                payload = {"steps": 16, "sleep": 0.5}
            else:
                payload = {"steps": rng.randint(2, 3), "sleep": rng.choice((0.1, 0.15, 0.2))}
            if self.mixed_leases and n % 2:
                payload["lease"] = "long"
            out.append(payload)
        return out


@dataclass
class Outcome:
    jobs: int
    statuses: dict[str, int]
    lost: int
    duplicate_effects: int
    faults: dict[str, int]
    stuck_running: int = 0
    extra: dict[str, int] = field(default_factory=dict)

    def line(self) -> str:
        s = self.statuses
        faults = sum(self.faults.values())
        detail = " ".join(f"{k}={v}" for k, v in self.faults.items())
        extra = "".join(f" {k}={v}" for k, v in self.extra.items())
        return (
            f"jobs={self.jobs} succeeded={s.get('succeeded', 0)} expired={s.get('expired', 0)} "
            f"failed={s.get('failed', 0)} lost={self.lost} duplicate_effects={self.duplicate_effects}"
            f"{extra} faults={faults} ({detail})"
        )


# --- services ---------------------------------------------------------------------------


@contextmanager
def scenario_database(prepare: Callable[[str], None]) -> Iterator[str]:
    """A fresh PostgreSQL database for one scenario run outside pytest; dropped after."""
    with throwaway_database("celery_lease_chaos") as url:
        prepare(url)
        yield url


@contextmanager
def private_redis(workdir: Path) -> Iterator[RedisServer]:
    server = RedisServer(workdir)
    server.start()
    try:
        yield server
    finally:
        server.stop()


class Fleet:
    """The scenario's workers (and beat), restartable under the same node names."""

    def __init__(
        self,
        db: str,
        redis_server: RedisServer,
        logdir: Path,
        scenario: Scenario,
        *,
        module: str,
        conf: dict | None = None,
        extra_env: dict | None = None,
        queues: str | None = None,
        with_beat: bool = False,
        beat_env_hook: Callable[[dict], dict] | None = None,
    ) -> None:
        self.db, self.redis, self.logdir, self.scenario = db, redis_server, logdir, scenario
        self.options = dict(
            module=module,
            conf=conf,
            extra_env=extra_env,
            queues=queues,
            concurrency=scenario.concurrency,
            pool=scenario.pool,
            as_deployed=scenario.as_deployed,
        )
        self.workers: list[Worker] = []
        #: Workers found ended when a fault came to kill them (kill looks first).
        self._exits: list[str] = []
        self.beat: Beat | None = None
        self.with_beat = with_beat
        self.beat_env_hook = beat_env_hook

    def _worker(self, name: str) -> Worker:
        return Worker(name, self.db, self.redis.url, self.logdir, **self.options).start()

    def start(self) -> Fleet:
        self.workers = [self._worker(f"w{i + 1}") for i in range(self.scenario.workers)]
        if self.with_beat:
            self.beat = Beat(
                self.db,
                self.redis.url,
                self.logdir,
                self.options["conf"],
                self.options["module"],
                extra_env=self.options["extra_env"],
                env_hook=self.beat_env_hook,
            ).start()
        return self

    def restart(self, index: int) -> None:
        """SIGKILL worker ``index`` (main process and pool) and boot it again, same name."""
        old = self.kill(index)
        time.sleep(0.5)
        self.workers[index] = self._worker(old.name)

    def kill(self, index: int) -> Worker:
        """SIGKILL worker ``index`` (main process and pool), noting first whether it had
        already ended on its own: a restart would hide that."""
        worker = self.workers[index]
        if worker.proc is not None and worker.proc.poll() is not None:
            self._exits.append(worker.name)
        worker.kill(signal.SIGKILL)
        return worker

    def exits(self, restarting: set[int] | frozenset[int] = frozenset()) -> list[str]:
        """Workers that ended that no fault killed (under faults a worker may lose its
        broker or its database, never end on its own): those found so by :meth:`kill`,
        and those ended now but the ones being restarted (``restarting``: indexes)."""
        ended = [
            w for i, w in enumerate(self.workers) if i not in restarting and w.proc is not None and w.proc.poll() is not None
        ]
        return self._exits + [w.name for w in ended]

    def stop(self) -> None:
        for w in self.workers:
            w.kill(signal.SIGKILL)
        if self.beat is not None:
            self.beat.kill()

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.logdir.glob("*.log")))


class FaultInjector:
    """Injects one fault every ``scenario.fault_every`` seconds, chosen by a seeded RNG
    (or in turn from ``scenario.fault_cycle``):
    SIGKILL a whole worker and restart it, SIGKILL one pool child, restart Redis (its
    queues vanish: no persistence), terminate the workers' PostgreSQL backends."""

    def __init__(self, fleet: Fleet, scenario: Scenario, *, db: str, app_name: str, cluster=None) -> None:
        self.fleet = fleet
        self.scenario = scenario
        self.rng = random.Random(scenario.seed + 1)
        self.admin = sa.create_engine(sa.engine.make_url(db), isolation_level="AUTOCOMMIT", pool_pre_ping=True)
        self.app_name = app_name
        self.counts = {kind: 0 for kind in (scenario.fault_cycle or FAULTS)}
        #: A tests.harness.pgcluster.PrivateCluster to crash once (scenario.pg_crash_at).
        self.cluster = cluster
        #: Jobs read back as succeeded just before the crash: all must still be after it.
        self.succeeded_before_crash: set[str] = set()

    def run(self, seconds: float) -> dict[str, int]:
        started = time.monotonic()
        deadline = started + seconds
        crash_at = None if self.scenario.pg_crash_at is None or self.cluster is None else started + self.scenario.pg_crash_at
        injected = 0
        try:
            cycle = self.scenario.fault_cycle or ()
            # A fault cycle is always gone through once, however slowly the faults go.
            while time.monotonic() < deadline or injected < len(cycle):
                time.sleep(self.scenario.fault_every)
                if crash_at is not None and time.monotonic() >= crash_at:
                    crash_at = None
                    self.crash_pg()
                    self.counts["crash_pg"] = 1
                    continue
                if cycle:
                    kind = cycle[injected % len(cycle)]
                else:
                    kind = self.rng.choices(FAULTS, WEIGHTS)[0]
                injected += 1
                if getattr(self, kind)():
                    self.counts[kind] = self.counts.get(kind, 0) + 1
        finally:
            self.admin.dispose()
        return self.counts

    def crash_pg(self) -> None:
        """PostgreSQL crashes (no checkpoint, every backend gone) and comes back."""
        from celery_lease.db.schema import jobs

        with self.admin.connect() as conn:
            succeeded = conn.execute(sa.select(jobs.c.id).where(jobs.c.status == "succeeded"))
            self.succeeded_before_crash = {str(r[0]) for r in succeeded}
        self.admin.dispose()
        self.cluster.crash()
        time.sleep(0.5)
        self.cluster.start()

    def kill_worker(self) -> bool:
        self.fleet.restart(self.rng.randrange(len(self.fleet.workers)))
        return True

    def kill_child(self) -> bool:
        children = self.rng.choice(self.fleet.workers).children()
        if not children:
            return False
        try:
            os.kill(self.rng.choice(children), signal.SIGKILL)
        except ProcessLookupError:
            return False
        return True

    def restart_redis(self) -> bool:
        return self.restart_broker()

    def restart_broker(self) -> bool:
        """The fleet's broker (a private Redis, or a private RabbitMQ node: SIGKILLed,
        booted again on its data) goes down and comes back."""
        self.fleet.redis.restart(downtime=0.5)
        return True

    def terminate_pg(self) -> bool:
        with self.admin.connect() as conn:
            n = conn.execute(
                sa.text(
                    "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND application_name = :app "
                    "AND pid <> pg_backend_pid()"
                ),
                {"app": self.app_name},
            ).scalar()
        return n > 0


# --- celery-lease ---------------------------------------------------------------------------

#: beat ticks fast and the maintenance tasks have their own queue, so a backlog of
#: wakeups in the default queue never delays (and expires) reaping and sweeping.
LEASE_CONF = {
    "lease_reap_interval": 1.0,
    "lease_sweep_interval": 1.0,
    "lease_sweep_stale_seconds": 10.0,
    "task_routes": {"celery_lease.*": {"queue": "celery_lease"}},
}
LEASE_QUEUES = "celery,celery_lease"


def scenario_env(scenario: Scenario) -> dict[str, str]:
    """The environment of the scenario's workers, beat and submitting process."""
    return {
        "CL_TEST_LEASE": str(scenario.lease),
        "CL_TEST_LONG_LEASE": str(scenario.long_lease),
        "CL_CHAOS_ATTEMPTS": str(scenario.attempts),
    }


def run_lease_scenario(
    db: str,
    redis_server: RedisServer,
    workdir: Path,
    scenario: Scenario,
    *,
    submit: Callable[[list[dict]], list[str]],
    cluster=None,
) -> Outcome:
    """Run the scenario against tests.apps.app_leases workers (the chaos kinds of
    tests.apps.app_faults and chaos_long); ``submit`` enqueues the payloads (in the
    caller's process) and returns the job ids. ``cluster``: the PrivateCluster behind
    ``db``, for ``scenario.pg_crash_at``."""
    from celery_lease.db.schema import jobs
    from tests.apps.app import effects

    hook = None
    if scenario.beat_skew is not None:
        from tests.harness import faketime

        skew = scenario.beat_skew

        def hook(env: dict) -> dict:
            return faketime.skewed_env(skew, env)

    fleet = Fleet(
        db,
        redis_server,
        workdir,
        scenario,
        module="tests.apps.app_leases",
        conf=LEASE_CONF,
        extra_env=scenario_env(scenario),
        queues=LEASE_QUEUES,
        with_beat=True,
        beat_env_hook=hook,
    )
    engine = sa.create_engine(db, pool_pre_ping=True)  # no application_name: the injector leaves it alone
    injector = FaultInjector(fleet, scenario, db=db, app_name="celery-lease", cluster=cluster)
    try:
        fleet.start()
        ids = submit(scenario.payloads())
        faults = injector.run(scenario.seconds)

        def settled() -> bool:
            with engine.connect() as conn:
                return conn.execute(sa.select(sa.func.count()).where(jobs.c.status.in_(["pending", "running"]))).scalar() == 0

        try:
            wait_for(settled, timeout=scenario.drain_seconds, interval=1.0, what="the jobs to settle")
        except AssertionError:
            pass  # reported below as lost / stuck running
        with engine.connect() as conn:
            statuses = dict(conn.execute(sa.select(jobs.c.status, sa.func.count()).group_by(jobs.c.status)).all())
            per_job = dict(conn.execute(sa.select(effects.c.job_id, sa.func.count()).group_by(effects.c.job_id)).all())
            succeeded = {str(r[0]) for r in conn.execute(sa.select(jobs.c.id).where(jobs.c.status == "succeeded"))}
            losses = conn.execute(sa.select(sa.func.coalesce(sa.func.sum(jobs.c.lease_losses), 0))).scalar()
        exits = fleet.exits()
    finally:
        fleet.stop()
        engine.dispose()
    unfinished = statuses.get("pending", 0) + statuses.get("running", 0)
    missing_effect = sum(1 for job_id in succeeded if per_job.get(job_id, 0) == 0)
    stray_effect = sum(1 for job_id in per_job if job_id not in succeeded)
    extra = {"stray_effects": stray_effect, "lease_losses": int(losses), "worker_exits": len(exits)}
    if scenario.pg_crash_at is not None:
        extra["succeeded_before_crash"] = len(injector.succeeded_before_crash)
        extra["lost_successes"] = len(injector.succeeded_before_crash - succeeded)
    return Outcome(
        jobs=len(ids),
        statuses=statuses,
        lost=unfinished + missing_effect,
        duplicate_effects=sum(1 for n in per_job.values() if n > 1),
        faults=faults,
        stuck_running=statuses.get("running", 0),
        extra=extra,
    )
