"""The chaos suite: several hundred jobs through worker, child, Redis and PostgreSQL
faults; afterwards nothing is lost, nothing committed twice, nothing stuck running.

The CI variant injects faults for 50 s. The long variant runs by hand::

    CHAOS_SECONDS=600 CHAOS_JOBS=2000 bash dev.sh test tests/test_chaos.py -m slow -s

The summary line is printed and written to $CHAOS_SUMMARY (default: the test's tmp dir).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import SUMMARY_LINES
from tests.e2e.chaos import LEASE_CONF, Scenario, run_lease_scenario


def _run(pg, broker, redis_server, client_app, tmp_path, request, scenario: Scenario):
    env = {"CL_TEST_LEASE": str(scenario.lease)}
    mod = client_app(pg, broker, conf=LEASE_CONF, extra_env=env, module="tests.apps.app_faults")

    def submit(payloads):
        return [j.id for j in mod.chaos.submit_many(payloads)]

    outcome = run_lease_scenario(pg, redis_server, tmp_path, scenario, submit=submit)
    line = "chaos: " + outcome.line()
    summary = Path(os.environ.get("CHAOS_SUMMARY") or tmp_path / "chaos-summary.txt")
    summary.write_text(line + "\n")
    # Shown in pytest's terminal summary (tests/conftest.py), so CI's log carries it.
    request.config.stash.setdefault(SUMMARY_LINES, []).append(line)
    print(line)

    assert outcome.jobs == scenario.jobs
    assert sum(outcome.faults.values()) > 0, line
    assert outcome.lost == 0, line
    assert outcome.duplicate_effects == 0, line
    assert outcome.extra["stray_effects"] == 0, line
    assert outcome.stuck_running == 0, line
    assert outcome.statuses.get("succeeded", 0) > 0, line
    assert set(outcome.statuses) <= {"succeeded", "expired", "failed"}, line


@pytest.mark.timeout(300)
def test_chaos(pg, broker, redis_server, client_app, tmp_path, request):
    _run(pg, broker, redis_server, client_app, tmp_path, request, Scenario())


@pytest.mark.slow
@pytest.mark.timeout(0)
@pytest.mark.skipif(not os.environ.get("CHAOS_SECONDS"), reason="long chaos: set CHAOS_SECONDS (e.g. 600)")
def test_chaos_long(pg, broker, redis_server, client_app, tmp_path, request):
    _run(pg, broker, redis_server, client_app, tmp_path, request, Scenario.from_env(jobs=2000))
