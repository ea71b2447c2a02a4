"""The chaos scenario of tests/chaos.py on plain Celery, for comparison.

Plain Celery as its docs recommend for reliability: ``task_acks_late=True``,
``worker_prefetch_multiplier=1``, ``task_reject_on_worker_lost`` left at its default,
and the task retries itself on database errors (``autoretry_for``). Each task sleeps
like the celery-lease job of the same payload, then writes its effect row directly.
The same faults are injected on the same schedule (same seed); there is no beat, since
plain Celery has nothing for it to do.

The Redis ``visibility_timeout`` is 10 s by default (``--visibility``): short enough
that messages of SIGKILLed workers are redelivered within the run, and shorter than
the long jobs (~8 s of work plus queueing), which shows the "long task outlives the
visibility timeout and runs twice" case. With Celery's default of one hour
(``--visibility 3600``) a SIGKILLed worker's unacknowledged messages are stranded for
that hour instead, and count as lost here.

    .venv/bin/python -m bench.chaos_plain_celery [--seconds 50] [--jobs 300] [--visibility 10]

Prints one line in the chaos suite's format (``lost`` = tasks whose effect never
landed; ``duplicate_effects`` = tasks whose effect landed more than once).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

import sqlalchemy as sa
from celery import Celery

TASK = "plain_chaos.work"
APP_NAME = "plain-celery"  # the PostgreSQL application_name the injector terminates

metadata = sa.MetaData()
plain_effects = sa.Table(
    "plain_effects",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("job_id", sa.String(36), nullable=False),
)

# --- the worker side (celery -A bench.chaos_plain_celery worker) --------------------------

app = Celery("plain_chaos", broker=os.environ.get("CL_TEST_BROKER", "memory://"))
app.conf.update(
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    broker_transport_options={"visibility_timeout": float(os.environ.get("PLAIN_VISIBILITY_TIMEOUT", "10"))},
)
_engine: sa.Engine | None = None
_engine_pid = 0


def engine() -> sa.Engine:
    global _engine, _engine_pid
    if _engine is None or _engine_pid != os.getpid():
        _engine = sa.create_engine(os.environ["CL_TEST_DB"], pool_pre_ping=True, connect_args={"application_name": APP_NAME})
        _engine_pid = os.getpid()
    return _engine


@app.task(
    name=TASK,
    bind=True,
    autoretry_for=(sa.exc.OperationalError, sa.exc.InterfaceError),
    retry_backoff=0.2,
    retry_backoff_max=1,
    max_retries=10,
)
def work(self, payload: dict) -> None:
    time.sleep(payload["steps"] * payload["sleep"])
    with engine().begin() as conn:
        conn.execute(plain_effects.insert().values(job_id=self.request.id))


# --- the driver -------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    from tests.harness.chaos import FaultInjector, Fleet, Outcome, Scenario, private_redis, scenario_database
    from tests.harness.services import wait_for

    parser = argparse.ArgumentParser(
        prog="python -m bench.chaos_plain_celery", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    defaults = Scenario()
    parser.add_argument("--seconds", type=float, default=defaults.seconds)
    parser.add_argument("--jobs", type=int, default=defaults.jobs)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--visibility", type=float, default=10.0, help="Redis visibility_timeout (s)")
    args = parser.parse_args(argv)
    scenario = Scenario(jobs=args.jobs, seconds=args.seconds, seed=args.seed)

    def prepare(url: str) -> None:
        e = sa.create_engine(url)
        metadata.create_all(e)
        e.dispose()

    with (
        tempfile.TemporaryDirectory(prefix="plain-chaos-") as tmp,
        private_redis(Path(tmp)) as redis_server,
        scenario_database(prepare) as db,
    ):
        fleet = Fleet(
            db,
            redis_server,
            Path(tmp),
            scenario,
            module="bench.chaos_plain_celery",
            extra_env={"PLAIN_VISIBILITY_TIMEOUT": str(args.visibility)},
        )
        counter = sa.create_engine(db)
        client = Celery("plain_chaos_client", broker=redis_server.url)

        def counts() -> dict[str, int]:
            with counter.connect() as conn:
                return dict(
                    conn.execute(sa.select(plain_effects.c.job_id, sa.func.count()).group_by(plain_effects.c.job_id)).all()
                )

        try:
            fleet.start()
            ids = []
            with client.producer_or_acquire() as producer:
                for payload in scenario.payloads():
                    job_id = str(uuid.uuid4())
                    client.send_task(TASK, args=[payload], task_id=job_id, producer=producer)
                    ids.append(job_id)
            faults = FaultInjector(fleet, scenario, db=db, app_name=APP_NAME).run(scenario.seconds)
            try:
                wait_for(
                    lambda: len(counts()) == len(ids), timeout=scenario.drain_seconds, interval=1.0, what="every task's effect"
                )
            except AssertionError:
                pass
            # Redeliveries after the visibility timeout may still land: give them one more.
            time.sleep(args.visibility + 5)
            per_job = counts()
        finally:
            fleet.stop()
            counter.dispose()
            client.close()

    landed = sum(1 for j in ids if per_job.get(j, 0) > 0)
    outcome = Outcome(
        jobs=len(ids),
        statuses={"succeeded": landed},
        lost=len(ids) - landed,
        duplicate_effects=sum(1 for j in ids if per_job.get(j, 0) > 1),
        faults=faults,
        extra={"extra_effect_rows": sum(max(0, n - 1) for n in per_job.values())},
    )
    print(f"plain-celery (acks_late, visibility_timeout={args.visibility:g}s): {outcome.line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
