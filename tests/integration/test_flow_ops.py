"""Flow control as operators meet it: `celery -A ... lease pause|resume|limits` as real
subprocesses, the HTTP API and the metrics, against PostgreSQL. Jobs are put in the
states to show with make_job; no worker runs."""

from __future__ import annotations

import json
import subprocess

import pytest
import sqlalchemy as sa

from celery_lease.db.schema import jobs, pauses
from celery_lease.errors import InvalidPayload
from tests.conftest import CELERY, ROOT, _env

MODULE = "tests.apps.app_flow"


@pytest.fixture
def cli(pg, broker):
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [CELERY, "-A", MODULE, "lease", *args], env=_env(pg, broker), cwd=ROOT, capture_output=True, text=True, timeout=120
        )

    return run


def paused_kinds(db: str) -> set[str]:
    with sa.create_engine(db).connect() as conn:
        return {r[0] for r in conn.execute(sa.select(pauses.c.kind))}


def test_pause_and_resume_from_the_cli_are_stored_and_resume_wakes_the_held(cli, pg, make_job):
    proc = cli("pause", "unlimited")
    assert (proc.returncode, proc.stdout.strip(), proc.stderr) == (0, "paused unlimited", "")
    assert paused_kinds(pg) == {"unlimited"}
    assert cli("pause", "unlimited").stdout.strip() == "unlimited was already paused"
    held = make_job(pg, kind="unlimited", task="tests.apps.app_flow.unlimited", held="pause")
    proc = cli("resume", "unlimited", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"kind": "unlimited", "paused": False, "woken": 1}
    assert paused_kinds(pg) == set()
    with sa.create_engine(pg).connect() as conn:
        row = conn.execute(sa.select(jobs.c.held, jobs.c.woken_at).where(jobs.c.id == held)).one()
    assert row.held is None and row.woken_at is not None


def test_pause_of_an_unknown_kind_is_refused_in_one_line_and_stores_nothing(cli, pg):
    proc = cli("pause", "no-such-kind")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("celery-lease: no job handler for kind 'no-such-kind'") and len(proc.stderr.splitlines()) == 1
    assert paused_kinds(pg) == set()


def test_priority_is_checked_at_submit_and_celery_s_priority_option_carries_it(pg, broker, client_app):
    mod = client_app(pg, broker, module=MODULE)
    for bad in (-1, 1.5, "9", True, 2**31):
        with pytest.raises(InvalidPayload, match="priority"):
            mod.unlimited.submit({}, priority=bad)
    with sa.create_engine(pg).connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(jobs)).scalar() == 0  # nothing stored
    assert mod.unlimited.submit({}, priority=7).priority == 7
    assert mod.unlimited.apply_async(({},), priority=3).priority == 3
    assert mod.unlimited.submit({}).priority == 0
