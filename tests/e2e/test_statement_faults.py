"""Focused, deterministic reproductions of what the history test (test_history.py)
found, each one statement faulted by the proxy (tests/harness/pgfaults.py) in front of
a real worker, in both modes of ``lease_prepare_statements``."""

from __future__ import annotations

import time

import pytest
import sqlalchemy as sa

from celery_lease.db.schema import jobs
from tests.conftest import wait_for

FLOW = "tests.apps.app_flow"
NATIVE = "tests.apps.app_native"
MODES = [pytest.param(True, id="prepared"), pytest.param(False, id="unprepared")]


def _row(pg: str, job_id: str) -> dict:
    engine = sa.create_engine(pg, poolclass=sa.pool.NullPool)
    with engine.connect() as conn:
        row = conn.execute(sa.select(jobs).where(jobs.c.id == job_id)).mappings().one()
    engine.dispose()
    return dict(row)


def _ended(pg: str, job_id: str, timeout: float) -> dict:
    """The job's row once it ended, or as it is after ``timeout`` (a job left running
    with no body shows here as ``running``)."""
    try:
        wait_for(lambda: _row(pg, job_id)["status"] not in ("pending", "running"), timeout=timeout, interval=0.2)
    except AssertionError:
        pass
    return _row(pg, job_id)


@pytest.mark.parametrize("prepared", MODES)
def test_a_snooze_is_retried_through_a_database_outage(pg, broker, client_app, workers, proxy, prepared):
    """A snooze never spends an attempt, also when its write meets a database that is
    away for a second (as a restart is): ``max_attempts=1`` snoozing once still
    succeeds. (History seed 3, threads pool: the snooze's write failed in a PostgreSQL
    crash, the job stayed running until reaped, and its attempt was spent.)"""
    conf = {"lease_prepare_statements": prepared}
    mod = client_app(pg, broker, conf=conf, module=FLOW)
    workers(proxy.url_for(pg), broker, conf=conf, module=FLOW, extra_env={"CL_TEST_LEASE": "3"})
    # The snooze's statement gives the attempt back (`attempt = attempt - 1`); every
    # try of it fails for a second, then the database is back.
    rule = proxy.fail("celery_lease_jobs.attempt - ", times=None)
    job = mod.snoozer.submit({"times": 1, "delay": 0})
    assert rule.wait(30), "the snooze's statement never ran"
    time.sleep(1.0)
    proxy.remove(rule)
    row = _ended(pg, job.id, timeout=10)
    assert (row["status"], row["attempt"], row["error"]) == ("succeeded", 1, None)
    assert row["result"] == {"snoozed": 1, "attempt": 1}


@pytest.mark.parametrize("prepared", MODES)
def test_a_rated_claim_whose_reply_was_lost_is_adopted(pg, broker, client_app, workers, proxy, prepared):
    """A rated kind's claim commits and its reply is lost: the worker's retry finds its
    own claim and runs the body, in the same delivery; no attempt is spent without a
    body (``max_attempts=1``: the job would otherwise expire after its lease)."""
    conf = {"lease_prepare_statements": prepared}
    mod = client_app(pg, broker, conf=conf, module=FLOW)
    workers(proxy.url_for(pg), broker, conf=conf, module=FLOW, extra_env={"CL_TEST_LEASE": "3"})
    # The claim counts itself in the kind's rate window, in the claim's transaction.
    rule = proxy.lose_reply("rate_claims")
    job = mod.rated.submit({})
    assert rule.wait(30), "no rated claim committed through the proxy"
    row = _ended(pg, job.id, timeout=10)
    assert (row["status"], row["attempt"], row["error"]) == ("succeeded", 1, None)


@pytest.mark.parametrize("prepared", MODES)
def test_a_chord_headers_failure_retried_after_a_dropped_connection_fires_the_errback_once(
    pg, broker, client_app, workers, proxy, prepared
):
    """A chord header job fails; the statement creating the body's leased errback
    meets a dropped connection (it never reaches the server) and the failure is written
    again: one errback job, not two. (History seed 113299, threads pool: a failed
    chord's body errback fired twice.)"""
    from celery import chord

    conf = {"lease_prepare_statements": prepared}
    mod = client_app(pg, broker, conf=conf, module=NATIVE)
    workers(proxy.url_for(pg), broker, conf=conf, module=NATIVE)
    # The client submits directly: the only job INSERT through the proxy is the errback's.
    rule = proxy.fail("INSERT INTO celery_lease_jobs")
    header = [mod.inc.s({"n": 0}), mod.inc.s({"n": 1}), mod.inc.s({"n": 2, "fail_at": 2})]
    chord(header, mod.total.s().on_error(mod.noted_error.s())).apply_async()
    assert rule.wait(30), "the errback's INSERT never ran"

    def errbacks() -> list:
        done = [j for j in mod.leases.store.list_jobs(kind="noted_error") if j.status.value in ("succeeded", "failed")]
        return done if done and all(j.status.value == "succeeded" for j in done) else []

    wait_for(errbacks, timeout=30, what="the errback to run")
    time.sleep(2)  # a second errback, if any, is created by then
    assert len(mod.leases.store.list_jobs(kind="noted_error")) == 1


def test_a_lost_claim_reply_is_adopted_while_another_thread_claims(pg, broker, client_app, workers, proxy, tmp_path):
    """A threads pool: the claim of one job commits and its reply is lost while another
    thread's claim is still on its way. The retry must adopt its own claim. (Both
    threads wrote the process's one lease owner, so the row found running could have
    been the other thread's: nothing was adopted and the job sat running with no body
    for its whole lease, then ran on a second attempt. History, threads pool: "attempt
    spent without a body" in 3 runs of 6.)"""
    app = "tests.apps.app"
    mod = client_app(pg, broker, module=app)
    workers(proxy.url_for(pg), broker, module=app, pool="threads", concurrency=4)
    other = mod.echo.submit({"value": "other"})
    slow = proxy.delay(other.id, 4.0)  # its claim stays in progress for 4 s
    assert slow.wait(30), "the other job's claim never ran"
    job = mod.echo.submit({"value": "lost", "marker_dir": str(tmp_path)})
    lost = proxy.lose_reply(job.id)  # the first statement naming the job: its claim
    assert lost.wait(30), "the claim never committed through the proxy"
    row = _ended(pg, job.id, timeout=15)  # far less than the 30 s lease
    assert (row["status"], row["attempt"], row["lease_losses"]) == ("succeeded", 1, 0)
    assert len((tmp_path / f"echo-{job.id}").read_text().split()) == 1  # the body ran once
    assert _ended(pg, other.id, timeout=15)["status"] == "succeeded"


def test_a_failure_whose_commit_reply_was_lost_before_a_partition_sends_its_plain_errback(
    pg, broker, client_app, workers, proxy, tmp_path
):
    """A job fails; its transaction commits, the reply is lost, and the database stays
    out of reach past 0.8 x the lease: the attempt is given up with the question it
    kept unasked. The failure had committed, so its plain errback must still be sent
    (at least once) when the database is back. (Before: the attempt raised LeaseLost,
    the errback was never applied, and nothing else knew of it.)"""
    conf = {"lease_connect_timeout": 1}
    mod = client_app(pg, broker, module=NATIVE)
    workers(proxy.url_for(pg), broker, conf=conf, module=NATIVE, extra_env={"CL_TEST_LEASE": "3"})
    lost = proxy.lose_reply("step 1 failed", then_pause=True)  # the failure's error text
    job = mod.inc.apply_async(({"n": 1, "fail_at": 1},), link_error=[mod.plain_errback.s(str(tmp_path))])
    assert lost.wait(30), "the failure never committed through the proxy"
    time.sleep(5.0)  # past 0.8 x the 3 s lease, and past the worker's tries to ask
    proxy.resume()
    assert _row(pg, job.id)["status"] == "failed"
    marker = tmp_path / f"errback-{job.id}"

    def sent() -> bool:
        mod.leases.sweep()  # what beat's sweep does: an outbox row older than a few seconds
        return marker.exists()

    wait_for(sent, timeout=30, interval=1.0, what="the plain errback of the committed failure")
