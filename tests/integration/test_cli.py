"""`celery -A tests.apps.app lease ...` as a real subprocess against PostgreSQL and Redis."""

from __future__ import annotations

import json
import subprocess
import uuid
from datetime import datetime, timedelta, timezone

import pytest
import sqlalchemy as sa

from celery_lease import Status
from celery_lease.db.schema import jobs
from celery_lease.db.statements import reads
from tests.conftest import CELERY, ROOT, _env, throwaway_database


@pytest.fixture
def cli(pg, broker):
    """cli(*args, db=None, env=None) -> CompletedProcess of `celery -A tests.apps.app lease *args`."""

    def run(*args: str, db: str | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            [CELERY, "-A", "tests.apps.app", "lease", *args],
            env=_env(db or pg, broker, extra=env),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )

    return run


def _rows(db: str) -> dict[str, dict]:
    with sa.create_engine(db).connect() as conn:
        return {str(r["id"]): dict(r) for r in conn.execute(sa.select(jobs)).mappings()}


def _one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode != 0, proc.stdout
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("celery-lease: "), proc.stderr
    return lines[0]


def test_migrate_is_repeatable(cli):
    for _ in range(2):
        proc = cli("migrate")
        assert proc.returncode == 0, proc.stderr
        assert "schema at revision" in proc.stdout


def test_show_as_text_and_json(cli, pg, make_job):
    job = make_job(
        pg,
        status="failed",
        attempt=3,
        error="source table is empty",
        result=None,
        progress={"rows": 120},
        finished_at=sa.func.now(),
        attempts=[
            {
                "attempt": 1,
                "owner": "w1@a/9/b",
                "started_at": "2026-11-30T10:00:00+00:00",
                "ended_at": "2026-11-30T10:01:00+00:00",
                "outcome": "lease expired",
            }
        ],
    )
    proc = cli("show", job)
    assert "  attempt 1  w1@a  2026-11-30T10:00:00+00:00 -> 2026-11-30T10:01:00+00:00  lease expired" in proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split(None, 1) for line in proc.stdout.splitlines() if len(line.split(None, 1)) == 2)
    assert lines["id"] == job and lines["status"] == "failed"
    assert lines["error"] == "source table is empty" and json.loads(lines["progress"]) == {"rows": 120}
    data = json.loads(cli("show", job, "--json").stdout)
    assert data["id"] == job and data["status"] == "failed" and data["attempt"] == 3
    assert data["progress"] == {"rows": 120} and data["finished_at"]
    assert data["attempts"] == [
        {
            "attempt": 1,
            "worker": "w1@a",
            "started_at": "2026-11-30T10:00:00+00:00",
            "ended_at": "2026-11-30T10:01:00+00:00",
            "outcome": "lease expired",
        }
    ]


def test_show_prints_the_checkpoint(cli, pg, make_job):
    """Before: show left the checkpoint out (where a failed job would resume). Now it
    is a field, as JSON; a large one is cut on the terminal, whole with --json."""
    job = make_job(pg, status="failed", finished_at=sa.func.now(), checkpoint={"offset": 42, "file": "a\x1b[2Jb"})
    proc = cli("show", job)
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split(None, 1) for line in proc.stdout.splitlines() if len(line.split(None, 1)) == 2)
    assert json.loads(lines["checkpoint"]) == {"offset": 42, "file": "a\x1b[2Jb"}
    assert "\x1b" not in proc.stdout  # escaped, as every value shown
    assert json.loads(cli("show", job, "--json").stdout)["checkpoint"] == {"offset": 42, "file": "a\x1b[2Jb"}
    big = make_job(pg, status="failed", finished_at=sa.func.now(), checkpoint={"rows": list(range(3000))})
    line = next(x for x in cli("show", big).stdout.splitlines() if x.startswith("checkpoint"))
    assert len(line) < 2100 and "--json shows all" in line
    assert json.loads(cli("show", big, "--json").stdout)["checkpoint"] == {"rows": list(range(3000))}
    none = make_job(pg, status="pending")
    assert json.loads(cli("show", none, "--json").stdout)["checkpoint"] is None


def test_retry_makes_one_new_job_of_an_ended_one(cli, pg, make_job):
    """``lease retry`` is the API's retry: a new job fenced above the original, once per
    job (retry the retry to try again); bad input changes nothing."""
    original = make_job(pg, status="failed", attempt=3, lease_generation=4, payload={"n": 2}, finished_at=sa.func.now())
    proc = cli("retry", original)
    assert proc.returncode == 0, proc.stderr
    new = proc.stdout.strip()
    row = _rows(pg)[new]
    assert (str(row["parent_id"]), row["status"], row["attempt"], row["lease_generation"]) == (original, "pending", 0, 4)
    assert row["payload"] == {"n": 2}
    line = _one_line_error(cli("retry", original))
    assert "already retried" in line and new in line
    pending = make_job(pg, status="pending")
    before = _rows(pg)
    for args, code, what in (
        (["retry", "not-a-uuid"], 2, "malformed job id"),
        (["retry", str(uuid.uuid4())], 1, "no job"),
        (["retry", pending], 1, "is pending: only failed, expired or cancelled jobs are retried"),
        (["retry", new], 1, "is pending"),
    ):
        proc = cli(*args)
        assert proc.returncode == code and what in _one_line_error(proc), (args, proc.stderr)
    assert _rows(pg) == before
    with sa.create_engine(pg).begin() as conn:
        conn.execute(sa.update(jobs).where(jobs.c.id == new).values(status="cancelled", lease_generation=6))
    data = json.loads(cli("retry", new, "--json").stdout)
    assert data["id"] == new and _rows(pg)[data["job_id"]]["lease_generation"] == 6


def test_show_takes_a_unique_id_prefix(cli, pg, make_job):
    twins = [make_job(pg, id=f"4faa87cc-0000-4000-8000-00000000000{i}") for i in (1, 2)]
    alone = make_job(pg, id="5e1f0a2b-0000-4000-8000-000000000003", status="failed", error="boom", finished_at=sa.func.now())
    for prefix in ("5e1f0a2b", "5E1F0A2B-00", "5e1f0a2b0000"):
        proc = cli("show", prefix, "--json")
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["id"] == alone
    line = _one_line_error(cli("show", "4faa87cc"))
    assert "ambiguous" in line and all(t in line for t in twins)
    assert "no job whose id starts with 'deadbeef'" in _one_line_error(cli("show", "deadbeef"))
    for bad in ("4faa87c", "4faa87cg", "4faa87cc-00000-4000-8000-0000000000011"):
        proc = cli("show", bad)
        assert proc.returncode == 2 and "malformed job id" in _one_line_error(proc), bad


def test_an_id_prefix_is_read_from_the_primary_key(pg):
    """Never a scan of the table: with sequential scans priced out, the plan is still
    a scan of the primary key's range (it would be a Seq Scan were the range not indexable)."""
    stmt = reads.ids_between("4faa87cc-0000-0000-0000-000000000000", "4faa87cc-ffff-ffff-ffff-ffffffffffff", 6)
    engine = sa.create_engine(pg)
    with engine.begin() as conn:
        conn.execute(sa.text("SET LOCAL enable_seqscan = off"))
        compiled = stmt.compile(dialect=conn.dialect, compile_kwargs={"literal_binds": True})
        plan = "\n".join(r[0] for r in conn.execute(sa.text(f"EXPLAIN {compiled}")))
    engine.dispose()
    assert "celery_lease_jobs_pkey" in plan and "Seq Scan" not in plan, plan


def test_list_filters_and_renders_an_aligned_table(cli, pg, make_job):
    failed = {make_job(pg, status="failed", error="boom", finished_at=sa.func.now()) for _ in range(2)}
    pending = make_job(pg, status="pending")
    steps = make_job(pg, status="pending", kind="steps", task="tests.apps.app.steps")

    proc = cli("list")
    assert proc.returncode == 0, proc.stderr
    header, *rows = proc.stdout.splitlines()
    assert header.split() == ["ID", "KIND", "STATUS", "ATTEMPT", "PROGRESS", "CREATED", "FINISHED", "ERROR"]
    assert len(rows) == 4
    status_col = header.index("STATUS")
    assert all(row[status_col:].split()[0] in ("failed", "pending") for row in rows)  # aligned

    data = json.loads(cli("list", "--status", "failed", "--json").stdout)
    assert {j["id"] for j in data["jobs"]} == failed and data["next_cursor"] is None
    data = json.loads(cli("list", "--kind", "steps", "--json").stdout)
    assert [j["id"] for j in data["jobs"]] == [steps]
    assert pending in {j["id"] for j in json.loads(cli("list", "--status", "pending", "--json").stdout)["jobs"]}


def test_list_pages_with_the_cursor(cli, pg, make_job):
    tie = datetime.now(timezone.utc) - timedelta(minutes=1)
    made = {make_job(pg, created_at=tie) for _ in range(3)} | {make_job(pg) for _ in range(2)}
    seen, cursor = [], None
    while True:
        args = ["list", "--limit", "2", "--json"] + (["--cursor", cursor] if cursor else [])
        data = json.loads(cli(*args).stdout)
        seen += [j["id"] for j in data["jobs"]]
        cursor = data["next_cursor"]
        if cursor is None:
            break
    assert len(seen) == len(set(seen)) == 5 and set(seen) == made
    # The text form says how to get the next page.
    assert "more: --cursor " in cli("list", "--limit", "2").stdout


def test_cancel_and_cancel_run(cli, pg, make_job):
    job = make_job(pg, status="pending")
    proc = cli("cancel", job, "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"id": job, "cancelled": True, "status": "cancelled"}
    assert _rows(pg)[job]["status"] == "cancelled"
    # A finished job is not cancelled again: one line and a non-zero exit.
    assert "already finished (cancelled)" in _one_line_error(cli("cancel", job))

    run = str(uuid.uuid4())
    in_run = [make_job(pg, status=s, run_id=run) for s in ("pending", "running", "succeeded")]
    proc = cli("cancel-run", run, "--json")
    assert json.loads(proc.stdout) == {"run_id": run, "cancelled": 2}
    rows = _rows(pg)
    assert [rows[j]["status"] for j in in_run] == ["cancelled", "cancelled", "succeeded"]


def test_reap_sweep_prune(cli, pg, make_job):
    expired_lease = make_job(
        pg, status="running", attempt=1, lease_owner="gone/1/boot", lease_expires_at=sa.text("now() - interval '5 seconds'")
    )
    held_lease = make_job(
        pg, status="running", attempt=1, lease_owner="alive/1/boot", lease_expires_at=sa.text("now() + interval '60 seconds'")
    )
    unwoken = make_job(pg, status="pending", woken_at=None)
    old = make_job(pg, status="succeeded", finished_at=sa.text("now() - interval '2 hours'"))
    recent = make_job(pg, status="succeeded", finished_at=sa.func.now())

    assert json.loads(cli("reap", "--json").stdout) == {"requeued": 1, "expired": 0}
    rows = _rows(pg)
    assert rows[expired_lease]["status"] == "pending" and rows[expired_lease]["lease_losses"] == 1
    assert rows[held_lease]["status"] == "running"

    sent = json.loads(cli("sweep", "--json").stdout)["sent"]
    assert sent == 1  # the unwoken job; the reaped one was woken by the reaper
    assert _rows(pg)[unwoken]["woken_at"] is not None

    assert json.loads(cli("prune", "--older-than", "3600", "--json").stdout) == {"deleted": 1}
    rows = _rows(pg)
    assert old not in rows and recent in rows
    assert cli("prune").returncode == 0  # default retention: a week; deletes nothing here
    assert recent in _rows(pg)


@pytest.mark.parametrize(
    "args, says",
    [
        (["show", "not-a-uuid"], "malformed job id"),
        (["show", "00000000-0000-4000-8000-000000000000"], "no job 00000000-0000-4000-8000-000000000000"),
        (["cancel", "00000000-0000-4000-8000-000000000000"], "no job"),
        (["cancel", "1234"], "malformed job id"),
        (["cancel-run", "run-7"], "malformed run id"),
        (["list", "--status", "done"], "unknown status 'done'"),
        (["list", "--limit", "0"], "limit must be an integer from 1 to 500"),
        (["list", "--limit", "many"], "limit must be an integer"),
        (["list", "--cursor", "bogus"], "malformed cursor"),
        (["prune", "--older-than", "soon"], "--older-than must be a number"),
        (["prune", "--older-than", "nan"], "--older-than must be a number"),
    ],
)
def test_bad_input_is_one_line_and_changes_nothing(cli, pg, make_job, args, says):
    job = make_job(pg, status="succeeded", finished_at=sa.text("now() - interval '1 day'"))
    before = _rows(pg)
    line = _one_line_error(cli(*args))
    assert says in line
    assert "Traceback" not in line
    assert _rows(pg) == before and job in before


@pytest.mark.parametrize(
    "args",
    [
        ["list"],
        ["show", "00000000-0000-4000-8000-000000000000"],
        ["cancel", "00000000-0000-4000-8000-000000000000"],
        ["reap"],
        ["sweep"],
        ["prune"],
        ["migrate"],
        ["serve", "--port", "0"],
    ],
)
def test_unreachable_database_is_one_line_without_the_password(cli, args):
    # Nothing listens on port 1; the URL carries a password that must not be echoed.
    db = "postgresql+psycopg2://root:hunter2-secret@127.0.0.1:1/nowhere"
    line = _one_line_error(cli(*args, db=db))
    assert "cannot reach the job database" in line
    assert "hunter2-secret" not in line


@pytest.mark.parametrize(
    "db, says",
    [
        (
            "postgresql+psycopg2://root:hunter2-secret@127.0.0.1:5432/no_such_db_3f1a",
            "the server at 127.0.0.1:5432 has no database 'no_such_db_3f1a'",
        ),
        ("postgresql+psycopg2://root:hunter2-secret@127.0.0.1:1/postgres", "cannot connect to the server at 127.0.0.1:1"),
    ],
)
def test_a_wrong_database_name_and_a_wrong_port_are_told_apart(cli, db, says):
    """Before: both were "cannot reach the job database ...: OperationalError"."""
    for args in (["list"], ["migrate"]):
        line = _one_line_error(cli(*args, db=db))
        assert line.endswith(says), line
        assert "hunter2-secret" not in line and "FATAL" not in line


def test_serve_refuses_a_malformed_token_setting(cli):
    line = _one_line_error(cli("serve", "--port", "0", env={"CELERY_LEASE_API_TOKENS": "admin=all"}))
    assert "CELERY_LEASE_API_TOKENS is not JSON" in line


def test_an_unmigrated_database_says_to_migrate(cli):
    with throwaway_database("celery_lease_cli_empty") as db:
        for args in (["list"], ["show", str(uuid.uuid4())], ["reap"]):
            assert "lease migrate" in _one_line_error(cli(*args, db=db))
        assert cli("migrate", db=db).returncode == 0
        assert cli("list", db=db).returncode == 0


def test_list_takes_celery_state_names_shows_progress_and_refuses_an_unknown_kind(cli, pg, make_job):
    done = make_job(pg, status="succeeded", attempt=1, result={"rows": 10})
    running = make_job(pg, status="running", attempt=1, progress={"rows": 5})
    retired = make_job(pg, kind="retired_kind", status="failed", error="old")  # no handler declares it any more

    def ids(*args: str) -> list[str]:
        proc = cli("list", *args, "--json")
        assert proc.returncode == 0, proc.stderr
        return [j["id"] for j in json.loads(proc.stdout)["jobs"]]

    assert ids("--status", "SUCCESS") == ids("--status", "Succeeded") == [done]
    assert ids("--status", "STARTED") == [running]
    assert ids("--status", "FAILURE") == [retired]
    assert ids("--kind", "retired_kind") == [retired]  # its jobs are still listed
    text = cli("list").stdout
    assert "PROGRESS" in text.splitlines()[0]
    assert [line for line in text.splitlines() if line.startswith(running)][0].count('{"rows":5}') == 1
    line = _one_line_error(cli("list", "--kind", "no_such_kind"))
    assert "no job handler for kind 'no_such_kind'" in line and "echo" in line


def test_weight_sets_a_tenants_weight_and_refuses_bad_input_changing_nothing(cli, pg):
    from celery_lease.db.schema import tenant_weights

    proc = cli("weight", "acme", "3")
    assert (proc.returncode, proc.stdout.strip()) == (0, "acme: weight 3"), proc.stderr
    for bad, says in (("0", "above 0"), ("-1", "above 0"), ("lots", "positive number"), ("nan", "above 0")):
        line = _one_line_error(cli("weight", "acme", bad))
        assert says in line, (bad, line)
    with sa.create_engine(pg).connect() as conn:
        assert conn.execute(sa.select(tenant_weights.c.tenant, tenant_weights.c.weight)).all() == [("acme", 3.0)]
    listed = json.loads(cli("tenants", "--json").stdout)["tenants"]
    assert [(t["tenant"], t["weight"]) for t in listed] == [("acme", 3.0)]
    assert cli("weight", "acme", "default").stdout.strip() == "acme: weight 1"
    with sa.create_engine(pg).connect() as conn:
        assert conn.execute(sa.select(tenant_weights)).all() == []


# --- the operator's terminal -------------------------------------------------------------


def test_lease_show_escapes_control_characters(pg, broker, make_job):
    """Before, `lease show` printed job data raw: an error or a kind holding escape
    sequences could rewrite the operator's terminal."""
    nasty = "\x1b]0;owned\x07\x1b[2J\rfake line\u202e"
    job = make_job(pg, status="failed", error=f"boom {nasty}", result={"k": nasty}, tenant=nasty, finished_at=sa.func.now())
    proc = subprocess.run(
        [CELERY, "-A", "tests.apps.app", "lease", "show", job],
        env=_env(pg, broker),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for ch in "\x1b\x07\r\u202e":
        assert ch not in out
    assert "boom \\x1b]0;owned\\x07\\x1b[2J\\rfake line\\u202e" in out
    listed = subprocess.run(
        [CELERY, "-A", "tests.apps.app", "lease", "list"],
        env=_env(pg, broker),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert listed.returncode == 0 and "\x1b" not in listed.stdout and "boom \\x1b" in listed.stdout
    assert Status.FAILED.value in listed.stdout
