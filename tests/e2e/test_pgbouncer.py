"""Workers, beat and the HTTP API behind PgBouncer in transaction mode.

A private PgBouncer (tests/harness/pgbouncer.py) with 4 server connections sits in front
of the run's database; every process under test (workers, beat, the API server) reaches
PostgreSQL only through it, with ``lease_prepare_statements = False`` (PgBouncer 1.18
keeps no session: a statement PREPAREd in one transaction is unknown in the next). The
clients outnumber the server connections, so transactions really queue for them and no
two consecutive transactions of a client can count on one backend: whatever celery-lease
needed a session for (LISTEN, session advisory locks, SET without LOCAL, prepared
statements, temporary tables) would fail here.

The test process itself checks the outcome over a direct connection.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time
from collections import Counter

import httpx
import pytest
import sqlalchemy as sa

from celery_lease.db.schema import jobs
from tests.apps.app import effects
from tests.conftest import CELERY, ROOT, _env, free_port, wait_for
from tests.e2e import test_flow
from tests.e2e.test_flow import max_overlap, span_rows
from tests.harness import pgbouncer
from tests.harness.pgfaults import PgFaultProxy

MODULE = "tests.apps.app_pgbouncer"
POOL_SIZE = 4
TOKEN = "pgbouncer-admin-token"
#: Beat's maintenance every second, and a pending job without a claim re-woken after 2 s.
BEAT = {"lease_reap_interval": 1.0, "lease_sweep_interval": 1.0, "lease_sweep_stale_seconds": 2.0}
UNPREPARED = {"lease_prepare_statements": False}

#: A direct engine on the run's database, with test_flow_spans (the limited bodies' spans).
db = test_flow.db

pytestmark = pytest.mark.skipif(not pgbouncer.available(), reason="needs pgbouncer (bash dev.sh test installs it)")


@pytest.fixture(scope="module")
def bouncer(pg_url):
    url = sa.engine.make_url(pg_url)
    with pgbouncer.private_pgbouncer(server_host=url.host or "127.0.0.1", server_port=url.port or 5432, pool_size=POOL_SIZE) as b:
        yield b


@pytest.fixture
def api(tmp_path):
    """api(db_url, broker, conf=UNPREPARED) -> (base URL, pid) of a `celery lease serve`
    on that database, killed at teardown."""
    procs: list[subprocess.Popen] = []

    def start(db_url: str, broker: str, conf: dict = UNPREPARED) -> tuple[str, int]:
        port = free_port()
        env = _env(db_url, broker, {**conf, "lease_api_rate": 0}, {"CELERY_LEASE_API_TOKENS": json.dumps({TOKEN: None})})
        log = open(tmp_path / "api.log", "a")
        proc = subprocess.Popen(
            [CELERY, "-A", MODULE, "lease", "serve", "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        procs.append(proc)
        base = f"http://127.0.0.1:{port}"

        def up() -> bool:
            assert proc.poll() is None, (tmp_path / "api.log").read_text()[-3000:]
            try:
                return httpx.get(base + "/openapi.json", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(up, timeout=30, what="the API server")
        return base, proc.pid

    yield start
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def rows(db, ids) -> dict[str, dict]:
    with db.connect() as conn:
        return {str(r["id"]): dict(r) for r in conn.execute(sa.select(jobs).where(jobs.c.id.in_(list(ids)))).mappings()}


def wait_ended(db, ids, timeout: float) -> dict[str, dict]:
    def ended():
        now = rows(db, ids)
        return now if all(r["status"] not in ("pending", "running") for r in now.values()) else None

    return wait_for(ended, timeout=timeout, interval=0.25, what=f"{len(ids)} jobs to end")


def pooled(bouncer) -> tuple[int, int]:
    """(clients, server connections) PgBouncer holds for the job database now."""
    clients = [c for c in bouncer.show("CLIENTS") if c["database"] != "pgbouncer"]
    servers = [s for s in bouncer.show("SERVERS") if s["database"] != "pgbouncer"]
    return len(clients), len(servers)


def test_workers_limits_batches_cancel_beat_and_api_through_pgbouncer(
    pg, broker, client_app, workers, beats, api, db, bouncer, make_job
):
    via = bouncer.url_for(pg)
    # A 30 s lease renews every 10 s: a running job's cancel seen sooner came as a notice.
    env = {"CL_TEST_LEASE": "30"}
    mod = client_app(via, broker, conf={**UNPREPARED, **BEAT}, extra_env=env, module=MODULE)
    fleet = [
        workers(via, broker, name="w1", module=MODULE, concurrency=2, conf=UNPREPARED, extra_env=env),
        workers(via, broker, name="w2", module=MODULE, concurrency=3, pool="threads", conf=UNPREPARED, extra_env=env),
    ]
    beats(via, broker, conf={**UNPREPARED, **BEAT}, module=MODULE)
    base, _ = api(via, broker)
    http = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)

    limited = [j.id for j in mod.limited2.submit_many([{"sleep": 0.3}] * 6)]
    rated = [j.id for j in mod.rated.submit_many([{}] * 10)]
    batched = [j.id for j in mod.b_note.submit_many([{"n": n} for n in range(10)])]
    # A job whose wakeup was lost (its row only): only beat's sweeper can start it.
    swept = make_job(pg, kind="echo", task="tests.apps.app.echo", payload={"value": "swept"})
    long = mod.steps.submit({"steps": 200, "sleep": 0.1})
    wait_for(lambda: rows(db, [long.id])[long.id]["status"] == "running", timeout=30, what="the long job to run")
    clients, servers = pooled(bouncer)
    assert clients > POOL_SIZE >= servers, (clients, servers)

    # Cancel the running job through the API: the table says cancelled at once, and its
    # worker stops the body well within the 10 s to its next renewal.
    cancelled_at = time.monotonic()
    assert http.post(f"/api/v1/jobs/{long.id}/cancel").status_code == 200
    assert http.get(f"/api/v1/jobs/{long.id}").json()["status"] == "cancelled"
    wait_for(
        lambda: any(f"job {long.id}: stopped after cancel" in w.log() for w in fleet),
        timeout=8,
        interval=0.1,
        what="the worker to stop the cancelled body",
    )
    noticed = time.monotonic() - cancelled_at

    done = wait_ended(db, [*limited, *rated, *batched, swept], timeout=60)
    assert {r["status"] for r in done.values()} == {"succeeded"}
    assert {r["attempt"] for r in done.values()} == {1}
    assert max_overlap(span_rows(db, "limited2")) <= 2
    per_second = Counter(math.floor(done[i]["started_at"].timestamp()) for i in rated)
    assert max(per_second.values()) <= 4, per_second
    assert [done[i]["result"]["n"] for i in batched] == list(range(10))
    assert done[swept]["result"] == {"echo": "swept", "attempt": 1}
    listed = http.get("/api/v1/jobs", params={"kind": "b_note", "limit": 50}).json()
    assert sorted(j["id"] for j in listed["jobs"]) == sorted(batched)

    final = rows(db, [long.id])[long.id]
    assert (final["status"], final["attempt"]) == ("cancelled", 1)
    assert noticed < 8


def test_killed_worker_and_lost_replies_behind_pgbouncer(pg, broker, client_app, workers, beats, db, bouncer):
    """Faults between the workers and PgBouncer (tests/harness/pgfaults.py): a rated
    claim and two successes commit and lose their replies, and the worker running a
    limited job is SIGKILLed; beat, through PgBouncer, reaps its job and the other worker
    finishes it from its checkpoint. Every job succeeds once: one effect row each, and
    no attempt is spent without a body (every attempt past the first is a lost lease)."""
    proxy = PgFaultProxy("127.0.0.1", bouncer.port).start()
    try:
        via = bouncer.url_for(pg)
        through_proxy = proxy.url_for(via)
        env = {"CL_TEST_LEASE": "3"}
        mod = client_app(via, broker, conf=UNPREPARED, extra_env=env, module=MODULE)
        fleet = {
            name: workers(
                through_proxy, broker, name=name, module=MODULE, concurrency=c, pool=pool, conf=UNPREPARED, extra_env=env
            )
            for name, pool, c in (("w1", "prefork", 2), ("w2", "threads", 3))
        }
        beats(via, broker, conf={**UNPREPARED, **BEAT}, module=MODULE)
        lost_claim = proxy.lose_reply("rate_claims")
        lost_successes = proxy.lose_reply("'succeeded'", times=2)

        rated = [j.id for j in mod.rated.submit_many([{}] * 6)]
        batched = [j.id for j in mod.b_note.submit_many([{"n": n} for n in range(8)])]
        # The kill comes after the kinds of one or two attempts have ended (a job of
        # theirs held by the killed worker would rightly expire); a limited job has six.
        done = wait_ended(db, [*rated, *batched], timeout=40)
        limited = [j.id for j in mod.chaos_limited.submit_many([{"steps": 12, "sleep": 0.25}] * 4)]

        def running_with_checkpoint():
            now = rows(db, limited).values()
            return next((r for r in now if r["status"] == "running" and (r["checkpoint"] or {}).get("i", 0) >= 2), None)

        victim = wait_for(running_with_checkpoint, timeout=40, interval=0.1, what="a limited job past checkpoint 2")
        fleet[victim["lease_owner"].split("@")[0]].kill(signal.SIGKILL)

        done |= wait_ended(db, limited, timeout=60)
        assert lost_claim.hits == 1 and lost_successes.hits == 2, proxy.events
    finally:
        proxy.close()
    assert {r["status"] for r in done.values()} == {"succeeded"}, [
        (r["kind"], r["status"], r["error"], r["attempt"]) for r in done.values()
    ]
    assert all(r["attempt"] == 1 + r["lease_losses"] for r in done.values())
    resumed = done[victim["id"]]
    assert resumed["attempt"] == 2 and resumed["result"]["resumed_from"] >= 2
    with db.connect() as conn:
        written = Counter(conn.execute(sa.select(effects.c.job_id, effects.c.attempt)).all())
    assert written == Counter((i, done[i]["attempt"]) for i in limited)
