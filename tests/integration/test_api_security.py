"""Issue 19, the API and the CLI: a hostile tenant or API client calls the real server
(`celery -A tests.apps.app lease serve`), an operator's stored values reach a real
terminal, on real PostgreSQL."""

from __future__ import annotations

import json
import re
import subprocess
import time
import uuid

import httpx
import pytest
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.dialects import postgresql

from celery_lease.db import migrate
from celery_lease.db.statements import flow as flow_statements
from celery_lease.db.statements import reads
from celery_lease.db.store import Store
from celery_lease.ops import listing
from tests.conftest import CELERY, ROOT, SUMMARY_LINES, _env, throwaway_database
from tests.integration.test_api import ACME, ADMIN, GLOBEX, Server

# --- finding 4: list pages are bounded ---------------------------------------------------


@pytest.fixture(scope="module")
def server(pg_url, redis_server, tmp_path_factory):
    srv = Server(pg_url, redis_server.url, tmp_path_factory.mktemp("api-security"))
    yield srv
    srv.stop()


def test_a_list_page_carries_summaries_and_the_job_route_the_whole_value(server, pg, make_job):
    """Before: 100 jobs with 0.9 MB results made a 90 MB page. A list row carries a
    result or progress only up to 1 KiB (else null, flagged, with its size)."""
    big = {"blob": "x" * 900_000}
    ids = [make_job(pg, status="succeeded", result=big, progress={"rows": 1}, finished_at=sa.func.now()) for _ in range(30)]
    small = make_job(pg, status="succeeded", result={"n": 1}, finished_at=sa.func.now())
    with server.client(ADMIN) as admin:
        r = admin.get("/api/v1/jobs", params={"limit": 500})
        assert r.status_code == 200
        assert len(r.content) < 64 * 1024, len(r.content)
        rows = {j["id"]: j for j in r.json()["jobs"]}
        assert set(rows) == {*ids, small}
        for job in ids:
            assert (rows[job]["result"], rows[job]["result_omitted"]) == (None, True)
            assert rows[job]["result_bytes"] >= 900_000
            assert (rows[job]["progress"], rows[job]["progress_omitted"]) == ({"rows": 1}, False)
        assert (rows[small]["result"], rows[small]["result_omitted"]) == ({"n": 1}, False)
        whole = admin.get(f"/api/v1/jobs/{ids[0]}")
        assert whole.status_code == 200 and whole.json()["result"] == big


def test_a_list_page_stops_at_its_byte_cap_and_pages_on(server, pg, make_job):
    """500 rows of values just under the summary limit would make a 1.3 MB page: the
    page stops before passing MAX_PAGE_BYTES, and its cursor reaches every job once."""
    value = {"v": "y" * (listing.SUMMARY_VALUE_BYTES - 20)}
    engine = sa.create_engine(pg)
    from celery_lease.db.schema import jobs

    now = time.time()
    rows = [
        {
            "id": str(uuid.uuid4()),
            "kind": "echo",
            "task": "tests.apps.app.echo",
            "status": "succeeded",
            "max_attempts": 1,
            "lease_seconds": 30,
            "payload": {},
            "result": value,
            "progress": value,
            "created_at": sa.func.to_timestamp(now - i),
            "updated_at": sa.func.now(),
        }
        for i in range(500)
    ]
    with engine.begin() as conn:
        for row in rows:
            conn.execute(jobs.insert().values(**row))
    engine.dispose()
    seen: list[str] = []
    cursor = None
    with server.client(ADMIN) as admin:
        while True:
            params = {"limit": 500, **({"cursor": cursor} if cursor else {})}
            r = admin.get("/api/v1/jobs", params=params)
            assert r.status_code == 200 and len(r.content) <= listing.MAX_PAGE_BYTES, len(r.content)
            page = r.json()
            assert all(j["result"] == value and not j["result_omitted"] for j in page["jobs"])
            seen += [j["id"] for j in page["jobs"]]
            cursor = page["next_cursor"]
            if cursor is None:
                break
    assert len(seen) > len(set(seen)) - 1 and sorted(seen) == sorted(r["id"] for r in rows)
    assert len(seen) == 500


# --- finding 5: /metrics ------------------------------------------------------------------


def _flow_series(text: str) -> dict[tuple[str, str, str], float]:
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return {(s.labels["kind"], s.labels["key"], s.labels["state"]): s.value for s in families["celery_lease_flow_jobs"].samples}


def test_metrics_need_a_token_and_show_no_concurrency_key_text(server, pg, make_job, client_app, broker):
    """Before: /metrics answered anyone, with one series per concurrency key, and the
    key is payload text (a customer's name here)."""
    for i in range(6):
        for _ in range(i + 1):
            make_job(pg, status="pending", held="limit", concurrency_key=f"customer-{i}-secret")
    for headers in ({}, {"Authorization": f"Bearer {ACME}"}, {"Authorization": "Bearer nope"}):
        r = httpx.get(server.url + "/metrics", headers=headers)
        assert (r.status_code, r.json()["error"]) == (401, "unauthorized"), headers
    r = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200 and "secret" not in r.text
    assert _flow_series(r.text)[("echo", "other", "waiting_limit")] == 21

    # An operator who opts in gets the busiest keys by name, the rest summed as "other".
    from celery_lease.ops import metrics

    mod = client_app(pg, broker, conf={"lease_metrics_key_labels": 2})
    series = _flow_series(metrics.render(mod.leases).decode())
    waiting = {key: v for (kind, key, state), v in series.items() if state == "waiting_limit"}
    assert waiting == {"customer-5-secret": 6, "customer-4-secret": 5, "other": 10}


# --- finding 9: expensive reads ------------------------------------------------------------


def test_each_token_has_a_request_rate(pg_url, redis_server, tmp_path):
    srv = Server(pg_url, redis_server.url, tmp_path, conf={"lease_api_rate": 2})  # bursts of 4
    try:
        with srv.client(ACME) as acme, srv.client(GLOBEX) as globex:
            codes = [acme.get("/api/v1/limits") for _ in range(8)]
            limited = [r for r in codes if r.status_code == 429]
            assert [r.status_code for r in codes].count(200) >= 4 and limited, [r.status_code for r in codes]
            assert limited[0].json()["error"] == "rate_limited"
            wait = int(limited[0].headers["Retry-After"])
            assert 1 <= wait <= 2
            assert globex.get("/api/v1/limits").status_code == 200  # another token's own budget
            time.sleep(wait)
            assert acme.get("/api/v1/limits").status_code == 200
    finally:
        srv.stop()


ROWS = 300_000


@pytest.fixture(scope="module")
def big_table():
    """A job table of 300k rows: mostly succeeded history, a few hundred failed, expired
    and cancelled, some pending (held or not) and running, across 50 tenants."""
    with throwaway_database("celery_lease_big") as url:
        store = Store(url)
        migrate.upgrade(store)
        store.dispose()
        engine = sa.create_engine(url)
        with engine.begin() as conn:
            conn.exec_driver_sql(
                f"""
                INSERT INTO celery_lease_jobs (id, kind, task, status, attempt, max_attempts, lease_seconds,
                    payload, tenant, concurrency_key, held, created_at, updated_at)
                SELECT gen_random_uuid(), 'k' || mod(i, 7), 'tests.apps.app.echo',
                       CASE WHEN mod(i, 1000) = 1 THEN 'failed' WHEN mod(i, 1000) = 2 THEN 'expired'
                            WHEN mod(i, 1000) = 3 THEN 'cancelled' WHEN mod(i, 1000) = 4 THEN 'running'
                            WHEN mod(i, 1000) IN (5, 6) THEN 'pending' ELSE 'succeeded' END,
                       1, 3, 30, '{{}}', 't' || mod(i, 50), 'key' || mod(i, 13),
                       CASE WHEN mod(i, 1000) = 6 THEN 'limit' END,
                       now() - i * interval '1 second', now()
                FROM generate_series(1, {ROWS}) AS i
                """
            )
            conn.exec_driver_sql("ANALYZE celery_lease_jobs")
        yield url, engine
        engine.dispose()


def _explain(engine, stmt) -> tuple[str, float]:
    sql = str(stmt.compile(dialect=postgresql.dialect(), compile_kwargs={"literal_binds": True}))
    with engine.connect() as conn:
        plan = "\n".join(r[0] for r in conn.exec_driver_sql(f"EXPLAIN (ANALYZE, BUFFERS) {sql}"))
    return plan, float(re.search(r"Execution Time: ([\d.]+) ms", plan).group(1))


def test_limits_and_unsuccessful_lists_read_indexes_not_the_table(big_table, request):
    """Before: /api/v1/limits was a (parallel) sequential scan of every row, ~110 ms at
    300k, and ?status=failed walked the created index over the whole history, for any
    tenant's token. Both read only the rows they count or return."""
    _, engine = big_table
    statements = {
        "limits": flow_statements.flow_counts(),
        "limits (tenant)": flow_statements.flow_counts("t7"),
        "failed": reads.list_jobs(columns=reads.VIEW_COLUMNS, status="failed", limit=51),
        "expired (kind)": reads.list_jobs(columns=reads.VIEW_COLUMNS, status="expired", kind="k3", limit=51),
        "failed (tenant)": reads.list_jobs(columns=reads.VIEW_COLUMNS, status="failed", tenant="t1", limit=51),
    }
    timings = {}
    for name, stmt in statements.items():
        plan, ms = min((_explain(engine, stmt) for _ in range(3)), key=lambda p: p[1])
        timings[name] = ms
        assert "Seq Scan on celery_lease_jobs" not in plan, (name, plan)
        removed = [int(n) for n in re.findall(r"Rows Removed by Filter: (\d+)", plan)]
        assert sum(removed) < 2000, (name, plan)  # reads what it returns, not the history
        assert "celery_lease_jobs_created" not in plan, (name, plan)
    line = f"issue 19, {ROWS} jobs, execution time (best of 3): " + ", ".join(f"{k} {v:.1f} ms" for k, v in timings.items())
    request.config.stash.setdefault(SUMMARY_LINES, []).append(line)


# --- findings 6 and 8: what the CLI prints --------------------------------------------------


def _cli(db: str, broker: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [CELERY, "-A", "tests.apps.app", "lease", *args],
        env=_env(db, broker),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_lease_limits_never_prints_a_control_sequence(pg, broker, make_job):
    """Before: `lease limits` printed a key with str(): an OSC title-change sequence in
    a concurrency key (payload text) reached the operator's terminal."""
    osc = "\x1b]0;pwned\x07\u202eevil\x9b31m"
    make_job(pg, status="pending", held="limit", concurrency_key=f"key{osc}")
    proc = _cli(pg, broker, "limits")
    assert proc.returncode == 0, proc.stderr
    assert not re.search("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202e]", proc.stdout), repr(proc.stdout)
    assert "key\\x1b]0;pwned\\x07" in proc.stdout
    # --json escapes them as JSON does.
    rows = json.loads(_cli(pg, broker, "limits", "--json").stdout)["kinds"]
    assert f"key{osc}" in {r["key"] for r in rows}


def test_a_query_string_password_is_never_echoed(pg, broker):
    """Before: display_url hid the user:password form only; `?password=` (which libpq
    reads as well) was printed by `lease migrate` and in every "cannot reach" line."""
    url = sa.engine.make_url(pg).update_query_dict({"password": "qs-hunter2", "sslpassword": "qs-ssl-hunter2"})
    proc = _cli(url.render_as_string(hide_password=False), broker, "migrate")
    assert proc.returncode == 0, proc.stderr
    assert "schema at revision" in proc.stdout and "hunter2" not in proc.stdout + proc.stderr
    unreachable = url.set(host="127.0.0.1", port=1).render_as_string(hide_password=False)
    for args in (["list"], ["migrate"], ["limits"]):
        proc = _cli(unreachable, broker, *args)
        assert proc.returncode != 0 and "cannot reach the job database" in proc.stderr, proc.stderr
        assert "hunter2" not in proc.stdout + proc.stderr, proc.stderr
