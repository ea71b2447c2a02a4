"""Failover (issue #29): the primary dies mid-run and its synchronous standby is promoted.

The jobs live on a private primary with a synchronous streaming standby
(tests/harness/pgcluster.py ``replicated_pair``). Workers (a prefork and a threads pool)
and beat reach them by libpq's multi-host URL with ``target_session_attrs=read-write``,
the workers through a fault proxy in front of the primary. The handlers
(tests/apps/app_history.py) record every body and fenced write in a history database on
the shared server, which the failover does not touch; tests/harness/history.py checks the
run: nothing lost, no two holders under one fencing token, no attempt spent without a
body, one effect per success.

The reply in flight: the proxy swallows the reply to a success's COMMIT and kills the
primary before the worker's connection drops, so the worker can only ask the promoted
standby whether its transaction landed (db/landing.py). The transaction's marker row
committed with it and was replicated synchronously, so the standby answers
"committed": the transition is not run again and its follow-ups go out.
"""

from __future__ import annotations

import re
import threading
import time
import uuid

import pytest
import sqlalchemy as sa

from celery_lease.db.statements import landing
from celery_lease.errors import DatabaseUnavailable
from tests.harness import history, pgcluster
from tests.harness.chaos import LEASE_CONF, LEASE_QUEUES
from tests.harness.history_run import read_history
from tests.harness.pgfaults import PgFaultProxy
from tests.harness.services import throwaway_database, wait_for

MODULE = "tests.apps.app_history"
#: Longer than the outage (as production's leases are), so the attempt whose reply was
#: lost still holds its lease when the promoted standby can be asked, and rides the
#: outage out instead of giving the attempt up by its own clock.
LEASE = 8
#: Submits this far apart, from before the kill until a while after the promotion.
SUBMIT_EVERY = 0.15
#: Between the primary's death and the promotion (an operator or Patroni deciding).
DOWNTIME = 1.0
#: The workers must be running bodies again this soon after the promotion.
RESUME_WITHIN = 10.0

UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


@pytest.fixture
def pair():
    if not pgcluster.available():
        pytest.skip("needs PostgreSQL server binaries (bash dev.sh test installs them)")
    with pgcluster.replicated_pair(max_connections=100) as clusters:
        yield clusters


@pytest.fixture
def history_url():
    from tests.apps.history_tables import history_metadata

    with throwaway_database("celery_lease_failover_history") as url:
        engine = sa.create_engine(url)
        history_metadata.create_all(engine)
        engine.dispose()
        yield url


def committed_mark(primary: pgcluster.PrivateCluster) -> str:
    """The token of a Landing's marker row (db/statements/landing.py) committed on
    ``primary``."""
    token = str(uuid.uuid4())
    engine = sa.create_engine(primary.url("jobs"), poolclass=sa.pool.NullPool)
    with engine.begin() as conn:
        conn.execute(landing.transaction_mark(False), {"token": token})
    engine.dispose()
    return token


def migrated(primary: pgcluster.PrivateCluster) -> None:
    from celery_lease.db import migrate
    from celery_lease.db.store import Store
    from tests.apps.app import test_metadata
    from tests.apps.history_tables import effect_metadata

    store = Store(primary.create_database("jobs"))
    migrate.upgrade(store)
    test_metadata.create_all(store.durable)
    effect_metadata.create_all(store.durable)
    store.dispose()


@pytest.mark.timeout(240)
def test_a_promoted_standby_takes_over_without_a_worker_restart(pair, history_url, broker, client_app, workers, beats, request):
    started = time.monotonic()
    primary, standby = pair
    migrated(primary)
    proxy = PgFaultProxy(primary.host, primary.port).start()
    # The workers' URL lists the primary (behind the proxy) and the standby in libpq's
    # one-parameter form; the test and beat list both directly.
    worker_url = (
        f"postgresql+psycopg2://{primary.user}@/jobs?host=127.0.0.1:{proxy.port},127.0.0.1:{standby.port}"
        "&target_session_attrs=read-write"
    )
    url = pgcluster.multi_host_url("jobs", primary, standby)
    env = {"CL_TEST_LEASE": str(LEASE), "CL_HISTORY_DB": history_url}
    mod = client_app(url, broker, conf=LEASE_CONF, extra_env=env, module=MODULE)
    fleet = [
        workers(worker_url, broker, name=name, conf=LEASE_CONF, extra_env=env, module=MODULE, queues=LEASE_QUEUES, pool=pool)
        for name, pool in (("w1", "prefork"), ("w2", "threads"))
    ]
    beats(url, broker, conf=LEASE_CONF, module=MODULE)

    ops: list[history.Op] = []
    stop = threading.Event()
    failed_submits = [0]

    def submit() -> None:
        # A stream of jobs; a submit that meets the outage is made again (DatabaseUnavailable:
        # it did not land, or landed and is found by its idempotency key).
        n = 0
        while not stop.is_set():
            n += 1
            while not stop.is_set():
                try:
                    job = mod.h_plain.submit({"steps": 2, "sleep": 0.1, "n": n}, idempotency_key=f"failover-{n}")
                    ops.append(history.Op(time.time(), "submit", job.id))
                    break
                except DatabaseUnavailable:
                    failed_submits[0] += 1
                    time.sleep(0.2)
            time.sleep(SUBMIT_EVERY)

    submitter = threading.Thread(target=submit, daemon=True)
    submitter.start()
    try:
        wait_for(lambda: len(ops) >= 15, timeout=30, what="jobs submitted")
        mark = committed_mark(primary)
        killed_at: list[float] = []

        def kill_primary() -> None:
            primary.crash()
            # The primary's address now refuses connections, as a dead host's does (a
            # proxy that accepted and then hung up would stop libpq from trying the
            # next host).
            proxy.close()
            killed_at.append(time.time())

        # The next success's COMMIT lands (and, synchronous, reaches the standby); its
        # reply is swallowed and the primary killed before the worker sees the drop.
        lost = proxy.lose_reply("history_effects", then=kill_primary)
        assert lost.wait(timeout=30), "no success committed through the proxy"
        time.sleep(DOWNTIME)
        standby.promote()
        promoted_at = time.time()
        time.sleep(6)
    finally:
        stop.set()
        submitter.join(timeout=30)
    assert not primary.is_running()
    # The Landing's question (db/statements/landing.py, settle_mark): a transaction
    # committed on the primary left its marker row, replicated synchronously, so the
    # promoted standby answers "committed" (no row back from the settling insert).
    with mod.leases.store.durable.begin() as conn:
        assert conn.execute(landing.settle_mark(), {"token": mark}).first() is None

    # Drain: every job submitted ends.
    def pending() -> int:
        with mod.leases.store.durable.connect() as conn:
            return conn.execute(sa.text("SELECT count(*) FROM celery_lease_jobs WHERE status IN ('pending', 'running')")).scalar()

    try:
        wait_for(lambda: pending() == 0, timeout=60, interval=0.5, what="every job to end after the failover")
    except AssertionError:
        with mod.leases.store.durable.connect() as conn:
            left = conn.execute(
                sa.text(
                    "SELECT id, status, attempt, lease_owner, lease_expires_at, run_after, updated_at, now()"
                    " FROM celery_lease_jobs WHERE status IN ('pending', 'running')"
                )
            ).all()
        raise AssertionError(f"{len(left)} jobs did not end: {left[:5]}\n" + "\n".join(w.log()[-4000:] for w in fleet)) from None
    h = read_history(url, history_url, ops, concurrency={}, rates={}, effect_kinds=frozenset({"h_plain"}))
    violations = history.check(h)
    assert not violations, history.report(h, violations, seed=0)

    submitted = {op.job_id for op in ops}
    assert set(h.jobs) == submitted and all(h.jobs[j]["status"] == "succeeded" for j in submitted)
    after = [b for b in h.bodies if b["started_at"] > promoted_at]
    assert after, "no body ran after the promotion"
    resumed = min(b["started_at"] for b in after) - promoted_at
    assert resumed < RESUME_WITHIN, f"the first body after the promotion started {resumed:.1f}s after it"
    # Both workers ran bodies on the promoted standby, in the processes they started with.
    for w in fleet:
        assert w.proc.poll() is None, f"worker {w.name} exited:\n{w.log()[-3000:]}"
        assert "ready." in w.log() and w.log().count("ready.") == 1
    pids = {b["pid"] for b in after}
    assert fleet[1].pid in pids, "the threads worker ran nothing after the promotion"
    assert pids - {fleet[1].pid}, "the prefork worker ran nothing after the promotion"

    # The success whose reply was lost: committed on the primary and (synchronous)
    # replicated before the reply was swallowed, so the promoted standby has it: it
    # stands, once, and the job is neither run again nor given another attempt. The
    # worker learns it either from the standby (its marker row is there: "committed",
    # not run again) or from its heartbeat, which finds the job no longer running under
    # its lease, whichever asks first.
    (event,) = [e for e in proxy.events if e.fault == "lose_reply"]
    found = UUID.search(event.statement)
    assert found is not None, event.statement
    job = h.jobs[found.group(0)]
    assert (job["status"], job["attempt"]) == ("succeeded", 1)
    assert [(e["attempt"], e["generation"]) for e in h.effects if e["job_id"] == job["id"]] == [(1, job["lease_generation"])]
    assert len([b for b in h.bodies if b["job_id"] == job["id"]]) == 1
    logs = "".join(w.log() for w in fleet)
    settled = ("a transition had committed before its reply was lost; not run again", f"job {job['id']}: lease lost")
    how = [name for name, text in zip(("committed", "heartbeat"), settled) if text in logs]
    assert how, "\n".join(line for line in logs.splitlines() if "celery-lease:" in line)[-3000:]

    line = (
        f"failover: {len(submitted)} jobs, primary killed {killed_at[0] - h.ops[0].at:.1f}s into the run, "
        f"promoted {DOWNTIME:.0f}s later; first body {resumed:.2f}s after the promotion; "
        f"{failed_submits[0]} submits retried; lost reply settled by {'+'.join(how)}; test {time.monotonic() - started:.0f}s"
    )
    from tests.conftest import SUMMARY_LINES

    request.config.stash.setdefault(SUMMARY_LINES, []).append(line)
    print(line)
