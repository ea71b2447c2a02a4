"""`celery-lease demo` as a subprocess: embedded default (SQLite + filesystem broker,
no server) and the same on PostgreSQL + Redis."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

SCRIPT = str(Path(sys.executable).with_name("celery-lease"))


def _demo(tmp_path, *extra: str) -> str:
    proc = subprocess.run(
        [SCRIPT, "demo", "--dir", str(tmp_path / ".demo"), "--rows", "8000", *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


def _check(out: str) -> None:
    assert "SIGKILL" in out and "reaper" in out
    assert re.search(r"resumed on w\d@demo, attempt 2, from its checkpoint at row [1-9]", out), out[-3000:]
    # The destination table: one line per source table, every one exactly once.
    checks = re.findall(r"│ (customers|orders|payments) +│ +([\d,]+) │ +([\d,]+) │ +([\d,]+) │ (\w+)", out)
    assert sorted(c[0] for c in checks) == ["customers", "orders", "payments"], out[-3000:]
    for _, source_rows, loaded, distinct, verdict in checks:
        assert source_rows == loaded == distinct and verdict == "yes"
    assert "demo passed" in out


def test_demo_runs_without_any_server(tmp_path):
    out = _demo(tmp_path)
    assert "filesystem://" in out and "sqlite:///" in out
    _check(out)


def test_demo_on_postgresql_and_redis(tmp_path, pg, broker):
    out = _demo(tmp_path, "--database-url", pg, "--broker-url", broker)
    assert "postgresql" in out and broker in out
    _check(out)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--workers", "1"], "--workers must be at least 2"),
        (["--rows", "5"], "--rows must be from 1000"),
        (["--database-url", "mysql://x/y"], "unsupported database"),
        (["--database-url", "postgresql+psycopg2://nobody@127.0.0.1:1/x"], "cannot reach the job database"),
        (["--broker-url", "redis://127.0.0.1:1/0"], "cannot reach the broker"),
    ],
)
def test_demo_refuses_bad_options(tmp_path, args, message):
    proc = subprocess.run(
        [SCRIPT, "demo", "--dir", str(tmp_path / ".demo"), *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0 and message in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr
