"""``ctx.fencing_token`` handed to a second system, with real workers: a Redis hash
written through a compare-and-set script (tests/apps/app_fencing.py, docs/fencing.md).
A holder whose lease was reaped while it stalled, and whose job another attempt now
holds, is refused; the current holder is accepted. The token grows with every claim,
a crash of PostgreSQL included."""

from __future__ import annotations

import os
import signal

import pytest
import redis

from celery_lease import Status
from celery_lease.ops.retry import retry_as_new
from tests.conftest import wait_for
from tests.e2e.test_faults import pid_in
from tests.e2e.test_worker_liveness_faults import crashable_pg, migrated  # noqa: F401  (a fixture)

APP = "tests.apps.app_fencing"
ENV = {"CL_TEST_LEASE": "3"}


def second_system(broker: str) -> redis.Redis:
    """The guarded store: another database of the private Redis than the broker's."""
    return redis.Redis.from_url(broker.rsplit("/", 1)[0] + "/5")


def maintain(mod) -> None:
    """Beat's work, as eagerly as it can be done: reap lapsed leases, re-send wakeups."""
    mod.leases.reap()
    mod.leases.sweep()


@pytest.mark.timeout(120)
def test_a_stale_holder_is_refused_by_the_second_system_and_the_current_holder_accepted(
    pg, broker, client_app, workers, marker_dir
):
    conf = {"lease_sweep_stale_seconds": 1}
    mod = client_app(pg, broker, conf=conf, extra_env=ENV, module=APP)
    workers(pg, broker, module=APP, conf=conf, extra_env=ENV, concurrency=2)
    url = broker.rsplit("/", 1)[0] + "/5"
    job = mod.fenced_write.submit({"redis": url, "key": "report:42", "marker_dir": str(marker_dir)})
    stalled = pid_in(marker_dir / "started-1")
    os.kill(stalled, signal.SIGSTOP)  # attempt 1 stalls (a GC pause, a swapped-out VM): no heartbeat
    try:
        wait_for(
            lambda: maintain(mod) or (marker_dir / "started-2").exists(),
            timeout=40,
            interval=0.25,
            what="attempt 2 to claim the job after attempt 1's lease was reaped",
        )
        (marker_dir / "go-2").touch()
        wait_for(lambda: mod.leases.get(job.id).status is Status.SUCCEEDED, timeout=30, what="attempt 2 to succeed")
    finally:
        (marker_dir / "go-1").touch()
        os.kill(stalled, signal.SIGCONT)  # attempt 1 wakes up and writes with its old token
    wait_for((marker_dir / "wrote-1").exists, timeout=30, what="the stale holder's write")

    token_1, verdict_1 = (marker_dir / "wrote-1").read_text().split()
    token_2, verdict_2 = (marker_dir / "wrote-2").read_text().split()
    assert (verdict_1, verdict_2) == ("refused", "accepted")
    assert int(token_1) < int(token_2)
    stored = second_system(broker).hgetall("report:42")
    assert stored == {b"token": token_2.encode(), b"value": b"attempt 2"}
    done = mod.leases.get(job.id)
    assert done.status is Status.SUCCEEDED and done.attempt == 2 and done.result == {"accepted": True}
    assert done.lease_generation == int(token_2)


@pytest.mark.timeout(300)
def test_the_fencing_token_grows_with_every_claim_across_a_postgresql_crash(
    crashable_pg,  # noqa: F811  (the fixture imported above)
    broker,
    client_app,
    workers,
    marker_dir,
):
    """Claims before and after an immediate stop of PostgreSQL (crash recovery from the
    WAL, whose writer flushes every 10 s: an asynchronous commit would be lost), a
    retry, and a whole worker SIGKILLed and reaped. Were a claim lost by the crash, the
    next claim would hand its token out again."""
    env = {"CL_TEST_LEASE": "5"}
    conf = {"lease_sweep_stale_seconds": 1}
    url = migrated(crashable_pg)
    mod = client_app(url, broker, conf=conf, extra_env=env, module=APP)
    w1 = workers(url, broker, name="w1", module=APP, conf=conf, extra_env=env)
    log = marker_dir / "tokens"

    def claims() -> list[tuple[int, int]]:
        text = log.read_text() if log.exists() else ""
        return [(int(a), int(t)) for a, t in (line.split() for line in text.splitlines())]

    def claimed(n: int) -> None:
        def step():
            try:
                maintain(mod)
            except Exception:  # (the database may be recovering)
                pass
            return len(claims()) >= n

        wait_for(step, timeout=60, interval=0.25, what=f"claim {n}")

    job = mod.fence_log.submit({"ok_at": 3, "marker_dir": str(marker_dir)})
    claimed(1)
    crashable_pg.crash()  # within milliseconds of the claim's commit
    crashable_pg.start()
    (marker_dir / "go-1").touch()  # attempt 1 fails: retried
    claimed(2)
    w1.kill()  # attempt 2 dies with its worker; its lease is reaped
    workers(url, broker, name="w2", module=APP, conf=conf, extra_env=env)
    claimed(3)
    for attempt in range(2, 6):
        (marker_dir / f"go-{attempt}").touch()
    wait_for(lambda: maintain(mod) or mod.leases.get(job.id).status is Status.SUCCEEDED, timeout=60, what="success")

    tokens = [token for _, token in claims()]
    assert len(tokens) >= 3
    assert all(a < b for a, b in zip(tokens, tokens[1:])), claims()
    assert mod.leases.get(job.id).lease_generation == tokens[-1]


@pytest.mark.timeout(120)
def test_a_retry_as_a_new_job_hands_out_tokens_above_every_token_of_the_original(pg, broker, client_app, workers, marker_dir):
    """The dashboard's and the API's retry (ops.retry) makes a new job for the same
    resource: a system that saw the original's tokens must accept the retry's writes,
    so the retry's first token is above every token the original handed out (its
    claims, and the cancel that revoked it)."""
    conf = {"lease_sweep_stale_seconds": 1}
    mod = client_app(pg, broker, conf=conf, extra_env=ENV, module=APP)
    workers(pg, broker, module=APP, conf=conf, extra_env=ENV)
    log = marker_dir / "tokens"
    for attempt in (1, 2, 3):
        (marker_dir / f"go-{attempt}").touch()
    job = mod.fence_log.submit({"ok_at": 3, "marker_dir": str(marker_dir)})
    # Attempt 1 fails and waits for its backoff (no beat runs: nothing wakes it).
    wait_for(lambda: mod.leases.get(job.id).status is Status.PENDING and log.exists(), timeout=30, what="attempt 1 to fail")
    assert mod.leases.cancel(job.id)
    original = mod.leases.get(job.id).lease_generation  # the cancel's revoke bumped it
    retry = retry_as_new(mod.leases, job.id)
    assert retry is not None
    wait_for(lambda: maintain(mod) or mod.leases.get(retry).status is Status.SUCCEEDED, timeout=60, what="the retry to succeed")

    tokens = [int(line.split()[1]) for line in log.read_text().splitlines()]
    assert len(tokens) == 4, tokens  # the original's attempt 1, the retry's three
    assert tokens[1] > original >= tokens[0], tokens
    assert all(a < b for a, b in zip(tokens, tokens[1:])), tokens
    new = mod.leases.get(retry)
    assert new.parent_id == job.id and new.attempt == 3 and new.lease_generation == tokens[-1]
