"""Liveness rules of issue #9 that need a real database but no worker: database time
for every due and staleness decision, bounded maintenance statements, idempotent
retries, the heartbeat's renewal statement.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import sqlalchemy as sa

from celery_lease.db.schema import jobs
from tests.conftest import ROOT, _env
from tests.harness import faketime
from tests.harness.services import wait_for


@pytest.fixture
def db(pg):
    engine = sa.create_engine(pg)
    yield engine
    engine.dispose()


def row(db, job_id: str) -> dict:
    with db.connect() as conn:
        return dict(conn.execute(sa.select(jobs).where(jobs.c.id == job_id)).mappings().one())


def seconds_from_db_now(db, value) -> float:
    with db.connect() as conn:
        return conn.execute(sa.select(sa.func.extract("epoch", sa.literal(value) - sa.func.now()))).scalar()


# --- clocks (item 9) ------------------------------------------------------------------------


@pytest.mark.skipif(not faketime.available(), reason="needs libfaketime and a C compiler (bash dev.sh test installs them)")
def test_a_submitting_host_an_hour_fast_moves_no_due_or_wakeup_time(pg, broker, redis_server, client_app, db):
    """woken_at and a relative run_after come from the database's clock: a host an
    hour fast used to stamp woken_at an hour ahead, hiding a lost wakeup from the
    sweeper for an hour, and to push a 2 s delay an hour out."""
    script = textwrap.dedent(
        """
        import json
        from tests.apps.app import echo
        now = echo.submit({"value": "now"})
        later = echo.submit({"value": "later"}, run_after=2)
        many = echo.submit_many([{"value": 1}, {"value": 2}], run_after=2)
        print(json.dumps([now.id, later.id] + [j.id for j in many]))
        """
    )
    env = faketime.skewed_env("+1h", _env(pg, broker))
    out = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    now_id, *delayed = json.loads(out.stdout.strip().splitlines()[-1])
    assert abs(seconds_from_db_now(db, row(db, now_id)["woken_at"])) < 60
    for job_id in delayed:
        r = row(db, job_id)
        assert r["woken_at"] is None
        assert 0 < seconds_from_db_now(db, r["run_after"]) < 60

    # The wakeup of the job due now is lost; the sweeper re-sends it once stale by the
    # database's clock (2 s here), not an hour later.
    redis_server.flush()
    mod = client_app(pg, broker, conf={"lease_sweep_stale_seconds": 1})
    swept: list[str] = []

    def sweep_all() -> bool:
        swept.extend(str(r["id"]) for r in mod.leases.store.claim_due_wakeups(1, 100))
        return set(swept) >= {now_id, *delayed}

    wait_for(sweep_all, timeout=20, interval=0.25, what="the sweeper to re-send every wakeup")
