"""Driving the test Django project (tests/apps/djangoproj) from tests: its environment,
its Django tables, and its web side run as a process of its own (drive.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import sqlalchemy as sa

from tests.conftest import ROOT, _env

PROJECT = "tests.apps.djangoproj"
SETTINGS = {"DJANGO_SETTINGS_MODULE": f"{PROJECT}.settings"}


def django_env(db: str, broker: str) -> dict:
    return _env(db, broker, extra=SETTINGS)


def run(args: list[str], env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def drive(scenario: str, db: str, broker: str) -> dict:
    """Run one scenario of tests/apps/djangoproj/drive.py; what it saw."""
    proc = run([sys.executable, "-m", f"{PROJECT}.drive", scenario], django_env(db, broker))
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(name="django_db")
def django_db_fixture(pg, broker):
    """The run's database (job tables emptied) with the project's Django tables."""
    run([sys.executable, "-m", "django", "migrate", "--noinput", "-v", "0"], django_env(pg, broker))
    yield pg
    engine = sa.create_engine(pg)
    with engine.begin() as conn:
        conn.exec_driver_sql("DROP TABLE IF EXISTS shop_order, django_migrations")
    engine.dispose()
