"""Untrusted wakeups and values PostgreSQL cannot store, through real `celery worker`
processes, real PostgreSQL and a private Redis (issue 10).

A wakeup is a Celery message anyone with access to the broker can forge; a handler's
return value, progress, checkpoint and failure message are whatever it produced. None
of them may run the wrong handler, burn an attempt, or leave a job stuck ``running``.
"""

from __future__ import annotations

import sqlalchemy as sa

from celery_lease import Status
from celery_lease.db.schema import jobs
from tests.conftest import wait_for

APP = "tests.apps.app_unstorable"
ECHO = "tests.apps.app.echo"


def _row(db: str, job_id: str) -> dict:
    engine = sa.create_engine(db)
    try:
        with engine.connect() as conn:
            return dict(conn.execute(sa.select(jobs).where(jobs.c.id == job_id)).mappings().one())
    finally:
        engine.dispose()


def _all_rows(db: str) -> list[dict]:
    engine = sa.create_engine(db)
    try:
        with engine.connect() as conn:
            return [dict(r) for r in conn.execute(sa.select(jobs)).mappings()]
    finally:
        engine.dispose()


def _untouched(row: dict) -> bool:
    return (row["status"], row["attempt"], row["lease_generation"], row["lease_owner"]) == ("pending", 0, 0, None)


# --- wakeups are untrusted ---------------------------------------------------------------


def test_a_wakeup_for_another_kinds_task_claims_nothing(pg, broker, client_app, workers, make_job):
    """Kind flaky's task carrying an echo job's id: before, flaky claimed the echo job
    and ran on its payload (here: raising the Failure the payload asks for)."""
    mod = client_app(pg, broker, module=APP)
    w = workers(pg, broker, module=APP)
    # A pending job with no wakeup of its own yet (nothing else can claim it first).
    job = make_job(pg, kind="echo", task=ECHO, payload={"failure": "flaky ran on echo's payload"}, woken_at=sa.func.now())
    mod.app.send_task("tests.apps.app.flaky", task_id=job)
    wait_for(lambda: f"job {job}: duplicate or not claimable" in w.log(), timeout=30, what="the forged wakeup to be consumed")
    assert _untouched(_row(pg, job))
    # Its own task's wakeup still runs it, as attempt 1.
    mod.app.send_task(ECHO, task_id=job)
    done = mod.leases.wait(job, timeout=30)
    assert done.status is Status.SUCCEEDED and done.attempt == 1 and done.error is None


def test_a_malformed_wakeup_is_refused_before_the_claim(pg, broker, client_app, workers, make_job):
    """Before, a wakeup with arguments was claimed, then Celery's call raised TypeError:
    the job sat running with no body until reaped, an attempt spent for nothing."""
    mod = client_app(pg, broker, module=APP)
    w = workers(pg, broker, module=APP)
    job = make_job(pg, kind="echo", task=ECHO, payload={"value": 5}, woken_at=sa.func.now())
    mod.app.send_task(ECHO, task_id=job, args=[{"value": "forged"}])
    mod.app.send_task(ECHO, task_id=job, kwargs={"payload": {"value": "forged"}})
    mod.app.send_task(ECHO, task_id="not-a-job-id")
    # A wakeup with a callback: Celery would apply it with this job's result.
    mod.app.send_task(ECHO, task_id=job, link=mod.app.signature(ECHO, args=({"value": "stolen"},)))
    wait_for(lambda: w.log().count("refused before the claim") >= 4, timeout=30, what="four refusals")
    assert _untouched(_row(pg, job))
    assert "TypeError" not in w.log()
    mod.app.send_task(ECHO, task_id=job)
    done = mod.leases.wait(job, timeout=30)
    assert done.status is Status.SUCCEEDED and done.attempt == 1 and done.result == {"echo": 5, "attempt": 1}


# --- values PostgreSQL cannot store ------------------------------------------------------


def test_values_postgresql_cannot_store_end_the_job_failed_with_a_clear_error(pg, broker, client_app, workers):
    """Before: a Failure message with NUL raised ValueError in the failure path, one with
    a lone surrogate UnicodeEncodeError in cap_error, and a result, progress or
    checkpoint with either made the driver refuse the write: each job stuck running."""
    conf = {"lease_max_result_bytes": 2000, "lease_max_progress_bytes": 1000}
    mod = client_app(pg, broker, conf=conf, module=APP)
    workers(pg, broker, conf=conf, module=APP)
    cases = {
        ("failure", "nul"): "gave up: before\ufffdafter",
        ("failure", "surrogate"): "gave up: lone \ufffd surrogate",
        ("result", "nul"): "result contains a NUL character (U+0000), which PostgreSQL cannot store",
        ("result", "surrogate"): "result contains a lone surrogate (not valid Unicode text)",
        ("progress", "nul"): "progress contains a NUL character (U+0000), which PostgreSQL cannot store",
        ("progress", "surrogate"): "progress contains a lone surrogate (not valid Unicode text)",
        ("checkpoint", "nul"): "checkpoint contains a NUL character (U+0000), which PostgreSQL cannot store",
        ("checkpoint", "surrogate"): "checkpoint contains a lone surrogate (not valid Unicode text)",
    }
    submitted = {key: mod.unstorable.submit({"where": key[0], "mode": key[1]}).id for key in cases}
    big_result = mod.unstorable.submit({"where": "big_result", "size": 5000}).id
    big_progress = mod.unstorable.submit({"where": "big_progress", "size": 5000}).id
    small = mod.unstorable.submit({"where": "big_result", "size": 100}).id  # under the caps: fine
    for key, job_id in submitted.items():
        done = mod.leases.wait(job_id, timeout=60)
        # Failed at once (retrying cannot make the value storable), with a message that
        # says why and quotes nothing.
        assert (done.status, done.attempt, done.error) == (Status.FAILED, 1, cases[key]), key
    done = mod.leases.wait(big_result, timeout=60)
    assert (done.status, done.attempt) == (Status.FAILED, 1)
    assert done.error.startswith("result is ") and done.error.endswith("over the cap of 2000 (lease_max_result_bytes)")
    done = mod.leases.wait(big_progress, timeout=60)
    assert done.status is Status.FAILED and done.error.endswith("over the cap of 1000 (lease_max_progress_bytes)")
    assert mod.leases.wait(small, timeout=60).status is Status.SUCCEEDED


def test_one_bad_result_never_costs_the_other_successes_of_its_batch(pg, broker, client_app, workers):
    """Successes are written in batches (one statement); before, one result holding NUL
    made PostgreSQL refuse the whole batch, every job of it left running although
    Celery had reported each one's success."""
    env = {"CL_TEST_COMPLETION_LINGER": "0.5"}  # gather the successes of one process in one batch
    mod = client_app(pg, broker, module=APP, extra_env=env)
    workers(pg, broker, module=APP, pool="threads", concurrency=8, extra_env=env)
    payloads = [{"value": i} for i in range(7)] + [{"where": "result", "mode": "nul"}]
    submitted = mod.unstorable.submit_many(payloads)
    finished = [mod.leases.wait(j.id, timeout=60) for j in submitted]
    assert [j.status for j in finished] == [Status.SUCCEEDED] * 7 + [Status.FAILED]
    assert [j.result for j in finished[:7]] == [{"ok": i, "attempt": 1} for i in range(7)]
    assert finished[7].error.startswith("result contains a NUL character")
