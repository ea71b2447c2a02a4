"""The history test: a randomized mixed workload over real workers, through the fault
proxy, with SIGKILLs, connection cuts and a PostgreSQL crash; then the history checker
(tests/harness/history.py) says whether the lease promise held.

    bash dev.sh test tests/e2e/test_history.py -s                  # the short runs
    HISTORY_SEED=1234 bash dev.sh test tests/e2e/test_history.py -s -k unprepared
    bash dev.sh test tests/e2e/test_history.py -m slow -s          # the long runs

Each run prints its seed and a summary line (also in pytest's terminal summary); a
failure prints every violation and an excerpt of the history around a few of them, and
keeps what explains it in test-artifacts/history-<mode>-<seed>/ (tests/harness/history_keep.py):
the workers' and beat's logs, the violations, and the rows and run events of the jobs
that did not end.
"""

from __future__ import annotations

import os
import random

import pytest

from tests.conftest import SUMMARY_LINES
from tests.harness import history, pgcluster
from tests.harness.history_keep import keep
from tests.harness.history_run import MODULE, Run, Workload, databases, worker_env

MODES = [
    pytest.param(True, "prefork", id="prepared"),
    pytest.param(False, "prefork", id="unprepared"),
    pytest.param(True, "threads", id="threads"),
]


@pytest.fixture
def history_dbs():
    if not pgcluster.available():
        pytest.skip("needs PostgreSQL server binaries (bash dev.sh test installs them)")
    with databases() as dbs:
        yield dbs


def _seed() -> int:
    return int(os.environ.get("HISTORY_SEED") or random.SystemRandom().randrange(1_000_000))


def _run(w: Workload, history_dbs, broker, redis_server, client_app, tmp_path, request) -> None:
    cluster, jobs_url, history_url = history_dbs
    mod = client_app(jobs_url, broker, conf=w.conf(), extra_env=worker_env(history_url), module=MODULE)
    print(f"history seed={w.seed} (replay: HISTORY_SEED={w.seed})")
    h, violations, text = None, [], ""
    try:
        h = Run(
            w, mod=mod, cluster=cluster, jobs_url=jobs_url, history_url=history_url, redis=redis_server, workdir=tmp_path
        ).execute()
        violations = history.check(h)
        line = f"history[{request.node.callspec.id}] seed={w.seed} {history.summary(h)} violations={len(violations)}"
        print(line)
        request.config.stash.setdefault(SUMMARY_LINES, []).append(line)
        assert len(h.jobs) >= w.items, line
        assert any(job["kind"] == "h_batch" for job in h.jobs.values()), line
        assert sum(history.summary(h)["faults"].values()) > 0, line
        if violations:
            text = history.report(h, violations, seed=w.seed)
            print(text)  # shown with -s even when the run is an expected failure
            raise history.HistoryViolated(text)
    except BaseException:
        try:
            kept = keep(f"history-{request.node.callspec.id}-{w.seed}", tmp_path, jobs_url, h, text or None, redis_server.url)
            print(f"history artifacts kept in {kept}; broker: {(kept / 'backlog.txt').read_text().strip()}")
        except Exception as exc:  # the run's own failure is what the test reports
            print(f"history artifacts not kept: {exc!r}")
        raise


@pytest.mark.timeout(300)
@pytest.mark.parametrize("prepared,pool", MODES)
def test_history(history_dbs, broker, redis_server, client_app, tmp_path, request, prepared, pool):
    concurrency = 4 if pool == "threads" else 2
    # Every fault of #27 in every run: a backend SIGKILLed (its COMMIT waiting in
    # commit_delay), a partition longer than the lease after a lost COMMIT reply, and a
    # batched claim's lost reply followed by a restart (3 s in).
    w = Workload(seed=_seed(), prepared=prepared, pool=pool, concurrency=concurrency, batch_restart_at=3.0)
    _run(w, history_dbs, broker, redis_server, client_app, tmp_path, request)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("prepared,pool", MODES)
def test_history_long(history_dbs, broker, redis_server, client_app, tmp_path, request, prepared, pool):
    concurrency = 4 if pool == "threads" else 2
    seconds = float(os.environ.get("HISTORY_SECONDS", "150"))
    w = Workload(
        seed=_seed(),
        prepared=prepared,
        pool=pool,
        concurrency=concurrency,
        items=int(seconds * 4),
        seconds=seconds,
        pg_crash_at=seconds / 2,
        batch_restart_at=seconds / 4,
        drain_seconds=180.0,
    )
    _run(w, history_dbs, broker, redis_server, client_app, tmp_path, request)
