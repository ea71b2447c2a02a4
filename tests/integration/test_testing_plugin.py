"""celery_lease.testing as a Celery shop's test suite meets it: installed, registered by
entry point, and used by a test module with no conftest.py (pytest run in a subprocess
on a sample project)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import PG_ADMIN

PROJECT = """
from celery import Celery

from celery_lease import CeleryLease, Failure

app = Celery("shopapp")  # no broker configured: the plugin's worker uses memory://
app.conf.task_routes = {"shopapp.celery.report*": {"queue": "reports"}}
leases = CeleryLease(app)


@leases.job(kind="double", max_attempts=2)
def double(ctx, payload):
    if payload["n"] < 0:
        raise Failure("negative")
    return {"n": payload["n"] * 2}


@leases.job(kind="report")
def report(ctx, payload):
    return {"n": payload["n"] + 1}


@leases.job(kind="flaky", max_attempts=3)
def flaky(ctx, payload):
    if ctx.attempt < 2:
        raise RuntimeError("transient")
    return {"attempt": ctx.attempt}
"""

#: The user's test file, as docs/converting.md shows it: no conftest, no fixture of its own.
USER_TESTS = """
from celery import chain

from celery_lease import Status

from shopapp.celery import double, flaky, report


def test_leased_jobs_run_in_an_in_process_worker(lease_worker):
    assert double.delay({"n": 21}).get(timeout=20) == {"n": 42}
    failed = lease_worker.wait(double.submit({"n": -1}).id, timeout=20)
    assert failed.status is Status.FAILED and failed.error == "negative"
    retried = lease_worker.wait(flaky.submit({}).id, timeout=30)  # delivered again by the plugin's sweeper
    assert retried.result == {"attempt": 2}


def test_a_routed_kind_runs_on_its_queue(lease_worker):
    job = lease_worker.wait(report.submit({"n": 1}).id, timeout=20)
    assert (job.status, job.queue, job.result) == (Status.SUCCEEDED, "reports", {"n": 2})


def test_wait_for_a_chains_last_step_before_it_exists(lease_worker):
    # The last step's row is created when the first succeeds: wait() waits for it.
    last = lease_worker.wait(chain(double.s({"n": 1}), report.s()).apply_async().id, timeout=20)
    assert (last.status, last.result) == (Status.SUCCEEDED, {"n": 3})


def test_each_test_gets_a_fresh_database(celery_lease, lease_database_url):
    assert celery_lease.store.list_jobs() == []
    assert celery_lease.store.display_url.split("/")[-1] in lease_database_url


def test_eager_too(lease_eager, celery_lease):
    lease_eager(celery_lease)
    assert double({"n": 2}).result == {"n": 4}
"""

#: A test module composing with Celery's celery_app fixture (installed by pytest-celery):
#: its jobs are declared on the test's app, still no conftest.
CELERY_APP_TESTS = """
import pytest

from celery_lease import CeleryLease


@pytest.fixture
def lease_app(celery_app):
    leases = CeleryLease(celery_app)

    @leases.job(kind="square")
    def square(ctx, payload):
        return payload * payload

    return celery_app


def test_jobs_of_celerys_own_test_app(lease_worker):
    assert lease_worker.task_for("square").delay(7).get(timeout=20) == 49
"""


def _run_user_suite(tmp_path, pg_admin: str | None) -> subprocess.CompletedProcess:
    (tmp_path / "shopapp").mkdir()
    (tmp_path / "shopapp" / "__init__.py").write_text("")
    (tmp_path / "shopapp" / "celery.py").write_text(PROJECT)
    (tmp_path / "test_shop.py").write_text(USER_TESTS)
    (tmp_path / "test_celery_app.py").write_text(CELERY_APP_TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\npythonpath = .\ncelery_lease_app = shopapp.celery:app\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CELERY_LEASE", "CL_TEST", "PYTEST_"))}
    if pg_admin:
        env["CELERY_LEASE_TEST_PG_ADMIN"] = pg_admin
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


# The PostgreSQL variant (a throwaway database per test) costs another pytest start-up: slow tier.
@pytest.mark.parametrize("database", ["sqlite", pytest.param("postgresql", marks=pytest.mark.slow)])
def test_a_user_test_module_needs_no_conftest(tmp_path, database):
    proc = _run_user_suite(tmp_path, PG_ADMIN if database == "postgresql" else None)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "6 passed" in proc.stdout
    assert not list(tmp_path.glob("*.sqlite3"))  # nothing written outside the tests' tmp_path
