"""``python -m bench dashboard [--rows N]``: does every dashboard page answer in
< 100 ms with a million jobs in the table?

On a throwaway PostgreSQL database: ``--rows`` jobs over 30 days (97% succeeded, 2%
failed, the rest cancelled or expired; five kinds; four tenants; one job in ten in a
run of a hundred), plus a live set of 8,000 pending, 1,000 held and 1,000 running jobs
(some leases lapsing), and run events for the last three days' runs; then ``VACUUM
ANALYZE``. The dashboard is served by uvicorn in this process and every page is
fetched over loopback with a signed-in session: wall time per request, full page
rendered, median and max of ``--samples`` requests after one warm-up.

Writes bench/results/dashboard.md. The fills are bench set-up, not product SQL.
"""

from __future__ import annotations

import statistics
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import sqlalchemy as sa

from bench import harness
from tests.harness.services import free_port

KINDS = ("extract", "load", "preview", "discover", "notify")
ADMIN, ACME = "bench-admin-token-6e0f1c", "bench-acme-token-2d9a47"
_KIND = "(ARRAY['extract','load','preview','discover','notify'])[1 + i % 5]"
_COLUMNS = """(id, kind, task, status, attempt, max_attempts, lease_seconds, lease_generation, lease_losses,
    lease_owner, lease_expires_at, woken_at, held, concurrency_key, payload, result, error, run_id, tenant,
    created_at, updated_at, started_at, finished_at)"""

FILL_HISTORY = f"""
INSERT INTO celery_lease_jobs {_COLUMNS}
SELECT gen_random_uuid(), {_KIND}, 'bench.dash.' || {_KIND}, s, 1, 3, 60, 1, (s = 'expired')::int,
    NULL, NULL, t, NULL, NULL, jsonb_build_object('table', 't' || (i % 1000), 'n', i),
    CASE WHEN s = 'succeeded' THEN jsonb_build_object('rows', i % 5000) END,
    CASE s WHEN 'failed' THEN 'source table is empty' WHEN 'expired' THEN 'lease expired' END,
    CASE WHEN i % 10 = 5 THEN md5('run' || (i / 1000))::uuid END,
    (ARRAY['acme', 'globex', 'initech', NULL])[1 + i % 4],
    t, t + interval '2 s', t + interval '0.5 s', t + interval '2 s'
FROM (
    SELECT i, now() - make_interval(secs => i * :span / :rows) AS t,
        CASE WHEN i % 200 < 194 THEN 'succeeded' WHEN i % 200 < 198 THEN 'failed'
             WHEN i % 200 = 198 THEN 'cancelled' ELSE 'expired' END AS s
    FROM generate_series(1, :rows) AS i
) AS g
"""

FILL_LIVE = f"""
INSERT INTO celery_lease_jobs {_COLUMNS}
SELECT gen_random_uuid(), {_KIND}, 'bench.dash.' || {_KIND}, s, (s = 'running')::int, 3, 60, (s = 'running')::int, 0,
    CASE WHEN s = 'running' THEN 'worker-' || (i % 8) || '/' || (1000 + i % 16) || '/b00t' END,
    CASE WHEN s = 'running' THEN now() + make_interval(secs => 60 - i % 90) END,
    CASE WHEN s = 'pending' AND held IS NULL THEN t END, held,
    CASE WHEN held IS NOT NULL THEN 'tenant-' || (i % 7) END,
    jsonb_build_object('table', 't' || (i % 1000), 'n', i), NULL, NULL, NULL,
    (ARRAY['acme', 'globex', 'initech', NULL])[1 + i % 4],
    t, t, CASE WHEN s = 'running' THEN now() - make_interval(secs => i % 90) END, NULL
FROM (
    SELECT i, now() - make_interval(secs => i * 0.05) AS t,
        CASE WHEN i % 10 = 0 THEN 'running' ELSE 'pending' END AS s,
        CASE WHEN i % 10 = 1 THEN 'limit' END AS held
    FROM generate_series(1, :live) AS i
) AS g
"""

FILL_EVENTS = """
INSERT INTO celery_lease_events (run_id, job_id, event, attempt, detail, created_at)
SELECT run_id, id, e, (e <> 'dispatched')::int, CASE WHEN e = 'claimed' THEN 'worker-1/1001/b00t' END,
    CASE WHEN e = 'dispatched' THEN created_at WHEN e = 'claimed' THEN started_at ELSE finished_at END
FROM celery_lease_jobs, unnest(ARRAY['dispatched', 'claimed', status]) AS e
WHERE run_id IS NOT NULL AND created_at > now() - interval '3 days' AND status <> 'pending'
ORDER BY created_at, e
"""


def make_app(url: str, broker: str, **settings):
    """A Celery app with the five kinds of the example pipeline (two with limits);
    ``settings`` are CeleryLease settings."""
    from celery import Celery

    from celery_lease import CeleryLease

    app = Celery("bench_dashboard", broker=broker)
    app.conf.update(broker_connection_retry_on_startup=True, lease_api_tokens={ADMIN: None, ACME: "acme"})
    leases = CeleryLease(app, url, install_beat=False, **settings)
    limits = {"load": {"concurrency": 4, "concurrency_key": lambda p: p.get("tenant")}, "notify": {"rate_limit": "20/s"}}
    for kind in KINDS:
        leases.job(kind=kind, name=f"bench.dash.{kind}", **limits.get(kind, {}))(lambda ctx, payload: None)
    return app, leases


def seed(url: str, rows: int, log, *, days: float = 30, live: int = 10_000) -> None:
    """``rows`` finished jobs over ``days``, and ``live`` pending (a tenth held), a
    tenth of them running."""
    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        for what, sql, params in (
            (f"{rows:,} finished jobs", FILL_HISTORY, {"rows": rows, "span": days * 86400.0}),
            (f"{live:,} live jobs", FILL_LIVE, {"live": live}),
            ("run events", FILL_EVENTS, {}),
        ):
            started = time.monotonic()
            conn.execute(sa.text(sql), params)
            log(f"filled {what} in {time.monotonic() - started:.1f}s")
        conn.exec_driver_sql("VACUUM ANALYZE")
    engine.dispose()


class Serving:
    """The API and dashboard on uvicorn in a thread of this process."""

    def __init__(self, leases) -> None:
        import uvicorn

        from celery_lease.ops.api import create_app

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(create_app(leases), host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the dashboard server did not start")
            time.sleep(0.05)

    def client(self, token: str) -> httpx.Client:
        client = httpx.Client(base_url=self.url, timeout=60)
        r = client.post("/dashboard/login", data={"token": token})
        assert r.status_code == 303, r.text[:300]
        return client

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def pages(url: str) -> list[tuple[str, str, str]]:
    """(what, token, path) of every page measured."""
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        run_job, run_id = conn.execute(
            sa.text(
                "SELECT id, run_id FROM celery_lease_jobs"
                " WHERE run_id IS NOT NULL AND status = 'failed' ORDER BY created_at DESC LIMIT 1"
            )
        ).one()
        old = conn.execute(sa.text("SELECT id FROM celery_lease_jobs ORDER BY created_at LIMIT 1")).scalar_one()
    engine.dispose()
    day = (datetime.now(timezone.utc) - timedelta(days=10)).strftime("%Y-%m-%dT%H:%M")
    day_end = (datetime.now(timezone.utc) - timedelta(days=9)).strftime("%Y-%m-%dT%H:%M")
    return [
        ("jobs, newest page", ADMIN, "/dashboard/jobs"),
        ("jobs, status failed", ADMIN, "/dashboard/jobs?status=failed"),
        ("jobs, status expired + kind load (rare: short page)", ADMIN, "/dashboard/jobs?status=expired&kind=load"),
        ("jobs, kind + queue + status pending", ADMIN, "/dashboard/jobs?kind=load&status=pending"),
        ("jobs, status running", ADMIN, "/dashboard/jobs?status=running"),
        ("jobs, one day 10 days ago", ADMIN, f"/dashboard/jobs?since={day}&until={day_end}"),
        ("jobs, payload field table = t7", ADMIN, "/dashboard/jobs?field=table&value=t7"),
        ("jobs, a run", ADMIN, f"/dashboard/jobs?run={run_id}"),
        ("jobs, search by id", ADMIN, f"/dashboard/jobs?q={old}"),
        ("jobs, tenant token", ACME, "/dashboard/jobs?status=failed"),
        ("one job (in a run, with events)", ADMIN, f"/dashboard/jobs/{run_job}"),
        ("one job, the oldest", ADMIN, f"/dashboard/jobs/{old}"),
        ("bulk confirmation: cancel pending", ADMIN, "/dashboard/bulk?action=cancel&status=pending"),
        ("kinds", ADMIN, "/dashboard/kinds"),
        ("live page", ADMIN, "/dashboard/live"),
        ("live.json (polled)", ADMIN, "/dashboard/live.json"),
        ("workers and leases", ADMIN, "/dashboard/workers"),
        ("reconciliation", ADMIN, "/dashboard/reconcile"),
    ]


def measure(serving: Serving, url: str, samples: int, log) -> list[dict]:
    clients = {token: serving.client(token) for token in (ADMIN, ACME)}
    out = []
    for what, token, path in pages(url):
        client = clients[token]
        first = client.get(path)
        assert first.status_code in (200, 303), f"{path}: {first.status_code} {first.text[:300]}"
        ms = []
        for _ in range(samples):
            started = time.perf_counter()
            r = client.get(path)
            ms.append((time.perf_counter() - started) * 1000)
            assert r.status_code in (200, 303), path
        row = {"page": what, "path": path, "median_ms": statistics.median(ms), "max_ms": max(ms), "bytes": len(first.content)}
        log(f"{what}: median {row['median_ms']:.1f} ms, max {row['max_ms']:.1f} ms")
        out.append(row)
    for client in clients.values():
        client.close()
    return out


def markdown(rows: list[dict], n: int, samples: int) -> str:
    lines = [
        f"Dashboard pages with {n:,} finished jobs + 10,000 live ones (median / max of {samples} requests, ms, loopback):",
        "",
        "| page | median ms | max ms | path |",
        "|---|---:|---:|---|",
    ]
    for r in rows:
        lines.append(f"| {r['page']} | {r['median_ms']:.1f} | {r['max_ms']:.1f} | `{r['path'][:70]}` |")
    return "\n".join(lines) + "\n"


def main(args, log) -> int:
    import tempfile

    dbs = harness.Databases()
    with tempfile.TemporaryDirectory(prefix="celery-lease-dash-") as tmp:
        redis = harness.RedisServer(Path(tmp))
        redis.start()
        try:
            url = args.database or dbs.create("dashboard")
            app, leases = make_app(url, redis.url)
            if not args.database:
                leases.create_schema()
                seed(url, args.rows, log)
            serving = Serving(leases)
            try:
                rows = measure(serving, url, args.samples, log)
            finally:
                serving.stop()
            leases.store.dispose()
            app.close()
        finally:
            redis.stop()
            dbs.close()
    text = markdown(rows, args.rows, args.samples)
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "dashboard.md").write_text(text)
    print(text)
    slow = [r for r in rows if r["median_ms"] >= 100]
    log(f"{len(slow)} page(s) at or over 100 ms (median)" if slow else "every page under 100 ms (median)")
    return 0
