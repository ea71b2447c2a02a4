#!/usr/bin/env bash
# One entry point for a fresh clone:
#   bash dev.sh demo   the example pipeline end to end on SQLite + a filesystem broker
#   bash dev.sh test   lint, types, the unit tier, the oldest declared Celery/kombu/redis
#                      (.venv-oldest), then the suite against real PostgreSQL, Redis,
#                      RabbitMQ and workers (with arguments: just `pytest ARGS`)
#   bash dev.sh bench  the side-by-side benchmarks (bench/README.md)
# Each command creates .venv and installs what it needs; `test` also starts (and if
# missing installs) PostgreSQL and Redis. Idempotent: run it as often as you like.
set -euo pipefail
cd "$(dirname "$0")"
ROOT=$PWD
VENV=$ROOT/.venv
PY=${PYTHON:-python3}

log() { printf '[dev.sh] %s\n' "$*" >&2; }

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

apt_install() {
  log "installing $* with apt-get"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  # (Waits for another apt-get holding the lock instead of failing.)
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=600 "$@" >/dev/null
}

venv() {
  # $1: the extras to install, e.g. "test"
  local extras=$1 stamp="$VENV/.installed-$1"
  if ! "$PY" -c 'import venv, ensurepip' 2>/dev/null; then
    apt_install python3-venv
  fi
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  # Reinstall when the package metadata changed since the last install.
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    log "installing celery-lease[$extras] into .venv"
    "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
    "$VENV/bin/python" -m pip install -q -e ".[$extras]"
    touch "$stamp"
  fi
}

venv_oldest() {
  # The oldest Celery, kombu and redis that pyproject.toml declares
  # (tests/oldest-constraints.txt), beside the newest in .venv; reinstalled when either
  # file changed since.
  local venv=$ROOT/.venv-oldest pins=tests/oldest-constraints.txt
  local stamp="$venv/.installed"
  [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$pins" -nt "$stamp" ]; then
    log "installing celery-lease[test] with the oldest declared pins into .venv-oldest"
    "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
    "$venv/bin/python" -m pip install -q -e ".[test]" -c "$pins"
    touch "$stamp"
  fi
}

ensure_postgres() {
  if pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; then return; fi
  if ! command -v pg_ctlcluster >/dev/null 2>&1; then
    apt_install postgresql postgresql-client
  fi
  local version
  version=$(ls /etc/postgresql | sort -V | tail -n 1)
  if [ ! -d "/etc/postgresql/$version/main" ]; then
    as_root pg_createcluster "$version" main
  fi
  local hba="/etc/postgresql/$version/main/pg_hba.conf"
  # Tests connect as the current user over 127.0.0.1 without a password.
  if ! grep -q '^host all all 127.0.0.1/32 trust' "$hba"; then
    as_root sed -i '1i host all all 127.0.0.1/32 trust' "$hba"
  fi
  log "starting PostgreSQL $version"
  as_root pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
  for _ in $(seq 1 60); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 0.5; done
  pg_isready -q -h 127.0.0.1 -p 5432 || { log "PostgreSQL did not start"; exit 1; }
  local me; me=$(id -un)
  if ! psql -h 127.0.0.1 -U "$me" -d postgres -Atc 'select 1' >/dev/null 2>&1; then
    as_root su postgres -c "createuser -s $me" || true
  fi
}

ensure_test_tools() {
  # Fault tests (tests/harness) crash and restart a private PostgreSQL of their own,
  # which needs the server binaries (initdb, pg_ctl), and run processes with a skewed
  # wall clock, which needs libfaketime and a C compiler (tests/harness/faketime.py
  # builds a small fix for libfaketime 0.9.10). Only apt-get when one is missing.
  local missing=()
  if ! compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null \
    || ! compgen -G '/usr/lib/postgresql/*/bin/pg_ctl' >/dev/null; then
    missing+=(postgresql)
  fi
  compgen -G '/usr/lib/*/faketime/libfaketime.so.1' >/dev/null \
    || compgen -G '/usr/lib/faketime/libfaketime.so.1' >/dev/null \
    || missing+=(faketime)
  command -v cc >/dev/null 2>&1 || missing+=(gcc libc6-dev)
  # The dashboard's browser tests (tests/e2e/test_dashboard.py) drive Debian's
  # headless chromium through chromedriver.
  command -v chromium >/dev/null 2>&1 || missing+=(chromium)
  command -v chromedriver >/dev/null 2>&1 || missing+=(chromium-driver)
  # Workers, beat and the API behind a private PgBouncer in transaction mode
  # (tests/harness/pgbouncer.py, tests/e2e/test_pgbouncer.py).
  command -v pgbouncer >/dev/null 2>&1 || [ -x /usr/sbin/pgbouncer ] || missing+=(pgbouncer)
  if [ ${#missing[@]} -gt 0 ]; then
    apt_install "${missing[@]}"
  fi
}

ensure_redis() {
  # The tests start their own private redis-server on a free port; they need the binary.
  command -v redis-server >/dev/null 2>&1 || apt_install redis-server
}

ensure_rabbitmq() {
  # RabbitMQ tests boot a private node on free ports (tests/harness/rabbitmq.py): they
  # need the server's scripts and Erlang, not a running service.
  [ -x /usr/lib/rabbitmq/bin/rabbitmq-server ] && command -v erl >/dev/null 2>&1 || apt_install rabbitmq-server
}

cmd=${1:-}
shift || true
case "$cmd" in
  demo)
    venv demo
    exec "$VENV/bin/celery-lease" demo "$@"
    ;;
  test)
    venv test
    if [ $# -eq 0 ]; then
      # Fast feedback first: lint, types and the service-free unit tier (seconds).
      log "ruff check / ruff format --check / mypy"
      "$VENV/bin/ruff" check celery_lease tests tasks bench
      "$VENV/bin/ruff" format --check celery_lease tests tasks bench
      "$VENV/bin/mypy"
      log "unit tier (no services)"
      "$VENV/bin/python" -m pytest tests/unit -q -x
    fi
    ensure_postgres
    ensure_test_tools
    ensure_redis
    ensure_rabbitmq
    export CL_TEST_PG_ADMIN=${CL_TEST_PG_ADMIN:-postgresql+psycopg2://$(id -un)@127.0.0.1:5432/postgres}
    if [ $# -eq 0 ]; then
      log "oldest declared Celery/kombu/redis (.venv-oldest): wakeup format, lifecycle, a worker kill"
      venv_oldest
      CL_TEST_OLDEST=1 "$ROOT/.venv-oldest/bin/python" -m pytest -q -p no:cacheprovider \
        tests/unit/test_oldest_pins.py tests/integration/test_submit_perf.py tests/integration/test_lifecycle.py \
        tests/e2e/test_faults.py::test_killed_worker_job_is_reaped_and_resumed_from_checkpoint
      log "integration and end-to-end tiers (PostgreSQL, Redis, RabbitMQ, worker processes)"
      # Two pytest processes (CL_TEST_WORKERS; 0 runs in this one): each has its own
      # private Redis, RabbitMQ node and throwaway database, and a file's tests stay in
      # one process (module fixtures: a replicated pair, PgBouncer). The tests mostly
      # wait on worker subprocesses, so two halve the run (29:49 -> 14:45 on 2 cores).
      exec "$VENV/bin/python" -m pytest tests --ignore=tests/unit -n "${CL_TEST_WORKERS:-2}" --dist loadfile \
        --durations=15  # the slowest, to keep the run short
    fi
    exec "$VENV/bin/python" -m pytest "$@"
    ;;
  bench)
    venv "test,bench"
    ensure_postgres
    ensure_redis
    exec "$VENV/bin/python" -m bench "$@"
    ;;
  *)
    echo "usage: bash dev.sh demo|test|bench [args]" >&2
    exit 2
    ;;
esac
