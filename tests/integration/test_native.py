"""Celery habits on leased tasks, in-process: beat entries, results, canvas checks,
eager mode and the pytest plugin (tests/e2e/test_native_workers.py has the worker side)."""

from __future__ import annotations

import logging
import sys

import pytest
import sqlalchemy as sa

# --- beat entries survive the project's configuration -------------------------------------

MAINTENANCE = {"celery_lease.reap", "celery_lease.sweep", "celery_lease.prune", "celery_lease.archive"}


@pytest.fixture
def django_app(sqlite_url, monkeypatch):
    """tests.apps.app_django freshly imported; ``late=True`` assigns beat_schedule after
    the configuration was loaded."""
    made = []

    def load(late: bool = False):
        monkeypatch.setenv("CL_TEST_DB", sqlite_url)
        monkeypatch.setenv("CL_TEST_BROKER", "memory://")
        if late:
            monkeypatch.setenv("CL_TEST_LATE_SCHEDULE", "1")
        else:
            monkeypatch.delenv("CL_TEST_LATE_SCHEDULE", raising=False)
        sys.modules.pop("tests.apps.app_django", None)
        import tests.apps.app_django as mod

        made.append(mod)
        return mod

    yield load
    for mod in made:
        mod.leases.store.dispose()
        mod.app.close()
    sys.modules.pop("tests.apps.app_django", None)


def test_entries_survive_config_from_object_and_a_lazy_schedule_assignment(django_app):
    mod = django_app()
    schedule = mod.app.conf.beat_schedule
    # CeleryLease(app) and leases.periodic() ran before the project configured the app.
    assert MAINTENANCE | {"dj-tick", "project-entry"} <= set(schedule)
    assert schedule["celery_lease.reap"]["schedule"] == 1.0  # CELERY_LEASE_REAP_INTERVAL was read
    # A second config_from_object reloads the configuration: still there.
    mod.app.config_from_object(mod.DjangoSettings, namespace="CELERY")
    assert MAINTENANCE | {"dj-tick"} <= set(mod.app.conf.beat_schedule)


def test_beat_puts_back_entries_a_late_assignment_dropped_and_names_them(django_app, tmp_path, caplog):
    from celery import signals
    from celery.beat import Service

    mod = django_app(late=True)
    assert set(mod.app.conf.beat_schedule) == {"project-entry"}  # what the assignment left
    service = Service(app=mod.app, schedule_filename=str(tmp_path / "beat-schedule"))
    scheduler = service.scheduler  # beat reads the schedule before beat_init, as `celery beat` does
    assert "celery_lease.reap" not in scheduler.schedule
    with caplog.at_level(logging.WARNING, logger="celery_lease.maintenance"):
        signals.beat_init.send(sender=service)
    assert MAINTENANCE | {"dj-tick", "project-entry"} <= set(scheduler.schedule)
    assert scheduler.schedule["celery_lease.sweep"].options["queue"] == "celery_lease"
    warned = [r.getMessage() for r in caplog.records if "beat schedule had no" in r.getMessage()]
    assert len(warned) == 1 and "celery_lease.reap" in warned[0] and "dj-tick" in warned[0]
    # Nothing missing at the next start: no warning.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="celery_lease.maintenance"):
        signals.beat_init.send(sender=service)
    assert not [r for r in caplog.records if "beat schedule had no" in r.getMessage()]
    service.scheduler.close()


def test_maintenance_ticks_are_logged_at_debug_other_tasks_at_info():
    from celery_lease.beat.entries import quiet_maintenance_logs

    quiet_maintenance_logs()
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Keep(level=logging.DEBUG)
    trace = logging.getLogger("celery.app.trace")
    trace.addHandler(handler)
    old = trace.level
    trace.setLevel(logging.DEBUG)
    try:
        for name in ("celery_lease.sweep", "proj.tasks.add"):
            trace.info(
                "Task %(name)s[%(id)s] succeeded in %(runtime)ss: %(return_value)s",
                {"name": name, "id": "x", "runtime": 0.1, "return_value": None},
            )
        logging.getLogger("celery.beat").info("Scheduler: Sending due task %s (%s)", "celery_lease.reap", "celery_lease.reap")
        trace.setLevel(logging.INFO)
        trace.info("Task %(name)s[%(id)s] received", {"name": "celery_lease.reap", "id": "y"})
    finally:
        trace.removeHandler(handler)
        trace.setLevel(old)
    levels = [(r.args["name"], r.levelname) for r in records if isinstance(r.args, dict)]
    # At DEBUG the tick shows as a DEBUG line; at INFO it is not written at all.
    assert levels == [("celery_lease.sweep", "DEBUG"), ("proj.tasks.add", "INFO")]


# --- AsyncResult and Job.get read the row ---------------------------------------------------


def test_async_result_state_and_get_for_each_status(pg, broker, client_app, make_job):
    from datetime import datetime, timezone

    from celery.exceptions import TaskRevokedError
    from celery.exceptions import TimeoutError as CeleryTimeout
    from celery.result import AsyncResult

    from celery_lease.errors import JobFailed

    mod = client_app(pg, broker, module="tests.apps.app_native")
    # The app had no result backend: CeleryLease installed its own.
    assert mod.app.conf.result_backend == "celery_lease.results:LeaseBackend"
    now = datetime.now(timezone.utc)
    rows = {
        "PENDING": make_job(pg, status="pending"),
        "RETRY": make_job(pg, status="pending", attempt=1),
        "STARTED": make_job(pg, status="running", attempt=1, progress={"done": 3}),
        "SUCCESS": make_job(pg, status="succeeded", attempt=1, result={"ok": 1}, finished_at=now),
        "FAILURE": make_job(pg, status="failed", attempt=3, error="source table is empty", finished_at=now),
        "EXPIRED": make_job(pg, status="expired", attempt=3, error="lease expired", finished_at=now),
        "REVOKED": make_job(pg, status="cancelled", finished_at=now),
    }
    states = {name: AsyncResult(job_id, app=mod.app).state for name, job_id in rows.items()}
    assert states == {**{k: k for k in rows}, "EXPIRED": "FAILURE"}
    assert mod.app.AsyncResult(rows["SUCCESS"]).get(timeout=5) == {"ok": 1}
    assert mod.app.AsyncResult(rows["STARTED"]).info == {"done": 3}  # progress, as a custom state's meta
    assert mod.app.AsyncResult(rows["SUCCESS"]).args == [{}]  # the payload
    with pytest.raises(JobFailed, match="source table is empty"):
        mod.app.AsyncResult(rows["FAILURE"]).get(timeout=5)
    with pytest.raises(JobFailed, match="lease expired"):
        mod.app.AsyncResult(rows["EXPIRED"]).get(timeout=5)
    with pytest.raises(TaskRevokedError):
        mod.app.AsyncResult(rows["REVOKED"]).get(timeout=5)
    assert mod.app.AsyncResult("00000000-0000-4000-8000-000000000000").state == "PENDING"
    with pytest.raises(CeleryTimeout):
        mod.app.AsyncResult(rows["PENDING"]).get(timeout=0.3)

    # delay() returns Celery's AsyncResult for the job; submit() a Job with get().
    result = mod.inc.delay({"n": 1})
    assert result.state == "PENDING" and result.job.kind == "inc" and result.id == result.job.id
    job = mod.inc.submit({"n": 1})
    with pytest.raises(CeleryTimeout):
        job.get(timeout=0.3)
    assert mod.leases.get(rows["SUCCESS"]).get(timeout=1) == {"ok": 1}
    with pytest.raises(JobFailed):
        mod.leases.get(rows["FAILURE"]).get()
    assert isinstance(mod.leases.get(rows["FAILURE"]).get(propagate=False), JobFailed)


def test_an_app_with_its_own_result_backend_keeps_it_and_leased_tasks_read_rows(pg, broker, client_app, make_job):
    mod = client_app(pg, broker, module="tests.apps.app_native", conf={"result_backend": "cache+memory://"})
    assert mod.app.conf.result_backend == "cache+memory://"
    done = make_job(pg, kind="inc", task="tests.apps.app_native.inc", status="succeeded", result={"n": 2})
    assert mod.inc.AsyncResult(done).get(timeout=5) == {"n": 2}
    assert mod.leases.AsyncResult(done).state == "SUCCESS"
    assert mod.inc.delay({"n": 1}).state == "PENDING"


# --- eager mode and celery_lease.testing ------------------------------------------------------


@pytest.fixture
def eager_app(sqlite_url, broker, client_app):
    """tests.apps.app_native in eager mode on SQLite, its broker a real (private) Redis
    that the tests check stays empty."""
    return client_app(sqlite_url, broker, module="tests.apps.app_native", conf={"task_always_eager": True})


def _broker_is_empty(broker_url: str) -> bool:
    import redis

    client = redis.Redis.from_url(broker_url)
    try:
        return client.dbsize() == 0
    finally:
        client.close()


def test_eager_mode_runs_handlers_in_process_with_the_lifecycle_rules(eager_app, broker, sqlite_url):
    from celery import chain

    from celery_lease import Status
    from celery_lease.errors import JobFailed

    mod = eager_app
    result = mod.inc.delay({"n": 1})
    assert result.state == "SUCCESS" and result.get() == {"n": 2}
    assert result.job.attempt == 1
    # Retries run at once (no backoff), to the end.
    retried = mod.flaky.apply_async(({"ok_at": 3},))
    assert retried.get() == {"ok_at": 3} and retried.job.attempt == 3
    exhausted = mod.flaky.apply(({},))
    assert exhausted.state == "FAILURE" and exhausted.job.attempt == 3
    assert exhausted.job.error.startswith("internal error: ConnectionError (ref ")
    with pytest.raises(JobFailed, match="bad input"):
        mod.flaky.delay({"failure": "bad input"}).get()
    # A direct call returns the finished Job.
    job = mod.inc({"n": 5})
    assert job.status is Status.SUCCEEDED and job.result == {"n": 6}
    # A retry sees the checkpoint of the attempt before it.
    assert mod.ckpt.delay({"mode": "retry"}).get() == {"seen": {"from": 1}, "attempt": 2}
    # Children and chain steps run here too.
    parent = mod.parent({"children": [1, 2]})
    kids = mod.leases.store.list_jobs(kind="echo")
    assert parent.status is Status.SUCCEEDED and sorted(k.result["echo"] for k in kids) == [1, 2]
    assert all(k.status is Status.SUCCEEDED for k in kids)
    assert chain(mod.inc.s({"n": 1}), mod.plain_bump.s(), mod.inc.s()).apply_async().get()["n"] == 13
    linked = mod.inc.apply_async(({"n": 1},), link=mod.inc.s())
    assert [j.result for j in mod.leases.store.list_jobs(kind="inc") if j.parent_id == linked.id] == [{"n": 3}]
    # Effects commit with each success, once: one row per succeeded inc job.
    engine = sa.create_engine(sqlite_url)
    with engine.connect() as conn:
        notes = [r[0] for r in conn.exec_driver_sql("SELECT note FROM test_effects")]
    engine.dispose()
    assert len(notes) == len(mod.leases.store.list_jobs(kind="inc", status="succeeded"))
    assert _broker_is_empty(broker)  # nothing was published


@pytest.mark.timeout(60)
@pytest.mark.parametrize("database", ["sqlite_url", "pg"])
@pytest.mark.parametrize("sql", ["INSERT INTO no_such_table VALUES (1)", "INSERT INTO test_effects VALUES ("])
def test_an_effects_own_sql_error_fails_the_job_like_any_exception(request, database, sql):
    """A handler's bad statement (a missing table, a syntax error) is its own error on
    either database, retried per its attempts, not taken for the database being away
    (which, on SQLite, retried it for ever)."""
    import re

    from celery import Celery

    from celery_lease import CeleryLease, Status
    from celery_lease.testing import eager

    url = request.getfixturevalue(database)
    app = Celery("effect_sql_error", broker="memory://")
    leases = CeleryLease(app, database_url=url)

    @leases.job(kind="bad_effect", max_attempts=2)
    def bad_effect(ctx, payload):
        ctx.effect(lambda conn: conn.exec_driver_sql(sql))
        return {"done": True}

    try:
        with eager(leases, url):
            job = bad_effect({})
    finally:
        leases.store.dispose()
        app.close()
    assert (job.status, job.attempt) == (Status.FAILED, 2)
    # Stored alike on both: PostgreSQL's class for a statement it refuses.
    assert re.fullmatch(r"internal error: sqlalchemy\.exc\.ProgrammingError \(ref [0-9a-f]{8}\)", job.error), job.error


def test_testing_plugin_beside_celerys_pytest_fixtures(pg, broker, tmp_path):
    """A project's conftest enables celery_lease.testing and celery.contrib.pytest; its
    tests run leased jobs eagerly and through Celery's in-process worker thread."""
    import subprocess

    from tests.conftest import ROOT, _env

    (tmp_path / "conftest.py").write_text('pytest_plugins = ["celery_lease.testing", "celery.contrib.pytest"]\n')
    (tmp_path / "test_project.py").write_text(
        """
import pytest
from celery_lease import CeleryLease, Failure, Status


def test_eager(lease_eager):
    from tests.apps import app_native as project

    leases = lease_eager(project.leases)
    assert project.echo.delay({"value": 1}).get() == {"echo": 1, "attempt": 1}
    assert project.flaky.apply(({"ok_at": 2},)).get() == {"ok_at": 2}
    job = project.parent({"children": [7]})
    assert job.status is Status.SUCCEEDED
    assert [j.result["echo"] for j in leases.store.list_jobs(kind="echo") if j.parent_id == job.id] == [7]


@pytest.fixture
def shop(celery_app, lease_database_url):
    leases = CeleryLease(celery_app, database_url=lease_database_url)

    @leases.job(kind="double", max_attempts=2)
    def double(ctx, payload):
        if payload < 0:
            raise Failure("negative")
        return payload * 2

    return leases, double


def test_celery_worker_fixture(shop, celery_worker):
    leases, double = shop
    assert double.delay(21).get(timeout=20) == 42
    job = double.submit(-1)
    assert leases.wait(job.id, 20).error == "negative"
"""
    )
    env = _env(pg, broker)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "2 passed" in proc.stdout


# --- packaging ---------------------------------------------------------------------------------


def test_the_wheel_holds_only_the_package(tmp_path):
    """`pip install celery-lease` must not install the example app as a top-level `tasks`
    package (the most common Celery module name), and must bring Redis support for kombu."""
    import subprocess
    import zipfile

    from tests.conftest import ROOT

    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", str(ROOT), "-w", str(tmp_path)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("celery_lease-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"celery_lease", wheel.name.split("-py3")[0] + ".dist-info"}
    assert "celery_lease/py.typed" in names
    assert any(n.startswith("celery_lease/db/migrations/versions/0002") for n in names)
    assert not any(n.startswith(("tasks/", "tests/", "bench/")) for n in names)
    metadata = next(n for n in names if n.endswith("/METADATA"))
    requires = [line for line in zipfile.ZipFile(wheel).read(metadata).decode().splitlines() if line.startswith("Requires-Dist")]
    assert any(r.startswith("Requires-Dist: celery[redis]") for r in requires)
