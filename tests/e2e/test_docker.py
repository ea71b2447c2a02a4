"""docker/: the compose file and Dockerfile, checked without a Docker engine.

The compose file is parsed and its wiring checked; then each celery-lease service's
own command is run here, with the compose environment pointed at the test PostgreSQL
and Redis instead of the `postgres` and `redis` containers (and a free port instead of
the published one).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess

import httpx
import pytest
import sqlalchemy as sa
import tomllib
import yaml

from celery_lease import Status
from celery_lease.db.migrate import VERSION_TABLE
from tests.conftest import CELERY, ROOT, free_port, throwaway_database, wait_for
from tests.e2e.test_pipeline import pipeline  # noqa: F401  (fixture)

COMPOSE = ROOT / "docker" / "compose.yaml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
APP_SERVICES = ("migrate", "worker", "beat", "flower", "api")
LONG_RUNNING = ("worker", "beat", "flower", "api")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


# --- the files ------------------------------------------------------------------------


def test_compose_has_every_service_wired_in_order(compose):
    services = compose["services"]
    assert set(services) == {"postgres", "redis", *APP_SERVICES}
    for name in APP_SERVICES:
        service = services[name]
        assert service["build"] == {"context": "..", "dockerfile": "docker/Dockerfile"}, name
        # The package's own commands, on the example application.
        assert service["command"][:3] == ["celery", "-A", "tasks.app"], name
        env = service["environment"]
        assert "@postgres:5432/" in env["CELERY_LEASE_DATABASE_URL"], name
        assert env["CELERY_BROKER_URL"].startswith("redis://redis:6379/"), name
    assert services["migrate"]["command"][3:] == ["lease", "migrate"]
    assert services["migrate"]["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    assert services["migrate"]["restart"] == "no"
    for name in LONG_RUNNING:
        assert services[name]["depends_on"] == {
            "migrate": {"condition": "service_completed_successfully"},
            "redis": {"condition": "service_healthy"},
        }, name
    worker = services["worker"]["command"]
    assert worker[3] == "worker" and "-E" in worker  # task events, for Flower
    # A stable node name: restart recovery finds the jobs of this node's earlier boot.
    assert services["worker"]["hostname"] and "worker@%h" in worker
    assert services["beat"]["command"][3] == "beat"
    assert services["flower"]["command"][3] == "flower"
    assert services["api"]["command"][3:5] == ["lease", "serve"]
    assert "/healthz" in " ".join(services["api"]["healthcheck"]["test"])
    assert "CELERY_LEASE_API_TOKENS" in services["api"]["environment"]
    assert "pg_isready" in " ".join(services["postgres"]["healthcheck"]["test"])
    assert services["redis"]["healthcheck"]["test"][-2:] == ["redis-cli", "ping"]


def test_dockerfile_builds_the_package_from_the_repository(compose):
    context = (COMPOSE.parent / compose["services"]["worker"]["build"]["context"]).resolve()
    assert context == ROOT
    assert (context / compose["services"]["worker"]["build"]["dockerfile"]).resolve() == DOCKERFILE
    instructions = [
        line.strip() for line in DOCKERFILE.read_text().splitlines() if line.strip() and not line.strip().startswith("#")
    ]
    copies = [shlex.split(line)[1:-1] for line in instructions if line.startswith("COPY ")]
    copied = {src for srcs in copies for src in srcs}
    for src in copied:
        assert (context / src).exists(), src
    # What `pip install .` needs: the metadata, the readme it names, both packages.
    readme = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["readme"]
    assert {"pyproject.toml", readme, "celery_lease", "tasks"} <= copied
    install = next(line for line in instructions if "pip install" in line)
    assert '".[api]"' in install and "flower" in install
    assert any(line.startswith("USER ") and "root" not in line for line in instructions)


# --- the commands, run here -----------------------------------------------------------


@pytest.fixture
def run_service(compose, tmp_path):
    """Start a service's command locally; returns (process, log path, port or None)."""
    started: list[subprocess.Popen] = []

    def start(name: str, db: str, broker: str, **env_overrides: str):
        service = compose["services"][name]
        env = dict(os.environ)
        env.update({key: str(value) for key, value in service["environment"].items()})
        env.update({"CELERY_LEASE_DATABASE_URL": db, "CELERY_BROKER_URL": broker, **env_overrides})
        command = [CELERY, *service["command"][1:]]
        port = None
        for i, arg in enumerate(command):  # the published port may be taken here
            if arg.startswith("--port="):
                port = free_port()
                command[i] = f"--port={port}"
            elif arg == "--port":
                port = free_port()
                command[i + 1] = str(port)
            elif arg in ("0.0.0.0", "--address=0.0.0.0"):
                command[i] = arg.replace("0.0.0.0", "127.0.0.1")
        log_path = tmp_path / f"{name}.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        started.append(proc)
        return proc, log_path, port

    yield start
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture
def empty_db():
    """A database with no tables at all, for the migrate step."""
    with throwaway_database("celery_lease_compose") as url:
        yield url


def _log(path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def test_migrate_command_creates_the_schema(run_service, empty_db, broker):
    proc, log, _ = run_service("migrate", empty_db, broker)
    assert proc.wait(timeout=120) == 0, _log(log)
    engine = sa.create_engine(empty_db)
    try:
        tables = set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()
    assert {"celery_lease_jobs", "celery_lease_runs", "celery_lease_events", VERSION_TABLE} <= tables
    assert "revision" in _log(log)
    # Run again (every `docker compose up` does): nothing to do, still success.
    proc, log, _ = run_service("migrate", empty_db, broker)
    assert proc.wait(timeout=120) == 0, _log(log)


def test_worker_command_runs_pipeline_jobs(run_service, pg, broker, pipeline):  # noqa: F811
    proc, log, _ = run_service("worker", pg, broker)
    wait_for(lambda: "ready." in _log(log) or proc.poll() is not None, timeout=60, what="the worker")
    assert proc.poll() is None, _log(log)[-3000:]
    p = pipeline(pg, broker)
    job = p.check_source.submit({"source": pg})
    done = p.leases.wait(job.id, timeout=30)
    assert done.status is Status.SUCCEEDED and done.result["dialect"] == "postgresql"
    assert done.lease_owner is None and f"Task tasks.pipeline.check_source[{job.id}] succeeded" in _log(log)


def test_beat_command_schedules_the_maintenance_tasks(run_service, pg, broker):
    proc, log, _ = run_service("beat", pg, broker)
    # The sweeper's entry (every 5 s by default) is the first due.
    wait_for(
        lambda: "Sending due task celery_lease.sweep" in _log(log) or proc.poll() is not None,
        timeout=60,
        interval=0.2,
        what="beat to send the sweep task",
    )
    assert proc.poll() is None, _log(log)[-3000:]


def test_flower_command_serves(run_service, pg, broker):
    proc, log, port = run_service("flower", pg, broker)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5)

    def healthy():
        assert proc.poll() is None, _log(log)[-3000:]
        try:
            return client.get("/healthcheck").text == "OK"
        except httpx.TransportError:
            return False

    wait_for(healthy, timeout=60, interval=0.2, what="Flower to answer")
    client.close()


def test_api_command_serves_health_and_jobs(run_service, pg, broker):
    proc, log, port = run_service("api", pg, broker, CELERY_LEASE_API_TOKENS='{"compose-test-token": null}')
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5)

    def healthz():
        assert proc.poll() is None, _log(log)[-3000:]
        try:
            return client.get("/healthz")
        except httpx.TransportError:
            return None

    assert wait_for(healthz, timeout=60, interval=0.2, what="the API to answer").status_code == 200
    assert client.get("/api/v1/jobs").status_code == 401
    ok = client.get("/api/v1/jobs", headers={"Authorization": "Bearer compose-test-token"})
    assert ok.status_code == 200
    client.close()


def test_compose_requires_an_api_token(compose):
    # `${VAR:?message}`: compose refuses to start the API without tokens rather than
    # serve an API that refuses everything.
    value = compose["services"]["api"]["environment"]["CELERY_LEASE_API_TOKENS"]
    assert re.fullmatch(r"\$\{CELERY_LEASE_API_TOKENS:\?[^}]+\}", value)
