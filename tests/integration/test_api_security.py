"""Issue 19, the API and the CLI: a hostile tenant or API client calls the real server
(`celery -A tests.apps.app lease serve`), an operator's stored values reach a real
terminal, on real PostgreSQL."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.dialects import postgresql

from celery_lease.db import migrate
from celery_lease.db.schema import limits
from celery_lease.db.statements import flow as flow_statements
from celery_lease.db.statements import reads
from celery_lease.db.store import Store
from celery_lease.ops import listing
from tests.conftest import CELERY, ROOT, SUMMARY_LINES, _env, throwaway_database
from tests.integration.test_api import ACME, ADMIN, GLOBEX, READER, Server

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


def _nested(depth: int, leaf: object = 1) -> object:
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


def test_a_deep_value_already_stored_is_omitted_not_a_server_error(server, pg, make_job):
    """Before: a result or progress 400 levels deep (under 1 KiB), stored as a row could
    hold it, made the job's route and every list page holding it answer 500 for good
    (the response serializer stops at 255 levels): paging could not get past the row.
    Now such a value is null with *_omitted, and every read path answers."""
    older = make_job(pg, status="succeeded", result={"n": 1}, created_at=sa.func.now() - sa.text("interval '1 minute'"))
    deep = make_job(pg, status="succeeded", result=_nested(400), progress=_nested(400), finished_at=sa.func.now())
    near = make_job(pg, status="running", progress=_nested(100), created_at=sa.func.now() + sa.text("interval '1 minute'"))
    with server.client(ADMIN) as admin:
        job = admin.get(f"/api/v1/jobs/{deep}")
        assert job.status_code == 200, job.text
        body = job.json()
        assert (body["result"], body["result_omitted"], body["progress"], body["progress_omitted"]) == (None, True, None, True)
        whole = admin.get(f"/api/v1/jobs/{near}").json()  # at the limit: shown whole
        assert (whole["progress"], whole["progress_omitted"]) == (_nested(100), False)
        seen, cursor = [], None
        while True:  # one job a page: the cursor pages past the deep row
            r = admin.get("/api/v1/jobs", params={"limit": 1, **({"cursor": cursor} if cursor else {})})
            assert r.status_code == 200, r.text
            seen += r.json()["jobs"]
            cursor = r.json()["next_cursor"]
            if cursor is None:
                break
    assert [j["id"] for j in seen] == [near, deep, older]
    assert (seen[1]["result"], seen[1]["result_omitted"], seen[1]["progress_omitted"]) == (None, True, True)
    with _signed_in(server, ADMIN) as board:
        assert deep in board.get("/dashboard/jobs").text
        assert board.get(f"/dashboard/jobs/{deep}").status_code == 200
    env = _env(pg, "redis://127.0.0.1:1/0")
    for args in (["show", deep], ["list"]):
        done = subprocess.run(
            [CELERY, "-A", "tests.apps.app", "lease", *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0 and deep in done.stdout, done.stderr[-2000:]


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
    # (An idle declared kind has zero series of its own: not a key.)
    waiting = {key: v for (kind, key, state), v in series.items() if state == "waiting_limit" and v}
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


# --- issue 28: the dashboard as safe as the API ----------------------------------------------


def _rss_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def _stream(url: str, path: str, total: int, *, declare: int | None = None) -> tuple[bytes, float]:
    """POST ``total`` bytes to ``path`` as a stream (chunked, or under a declared
    Content-Length): what the server answered, and the seconds it took."""
    import socket
    import threading
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=60)
    length = f"Content-Length: {declare}" if declare is not None else "Transfer-Encoding: chunked"
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-www-form-urlencoded\r\n{length}\r\n\r\n"
    chunk = b"token=" + b"a" * (1024 * 1024 - 6)
    started = time.monotonic()

    def send() -> None:
        try:
            sock.sendall(head.encode())
            for _ in range(total // len(chunk)):
                sock.sendall(chunk if declare is not None else b"%x\r\n%s\r\n" % (len(chunk), chunk))
            if declare is None:
                sock.sendall(b"0\r\n\r\n")
        except OSError:  # the server answered and closed: the rest is not wanted
            pass

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    answer = b""
    try:
        while b"\r\n\r\n" not in answer:
            data = sock.recv(65536)
            if not data:
                break
            answer += data
    except OSError:
        pass
    elapsed = time.monotonic() - started
    sock.close()
    sender.join(timeout=60)
    return answer, elapsed


def test_a_body_is_bounded_before_it_is_read(pg_url, redis_server, tmp_path, request):
    """Before: the sign-in form read the whole body, then checked its size: an anonymous
    300 MB POST took the server from 108 MB to 704 MB. Now a declared length over the
    bound is refused unread, and a streamed one as soon as it passes the bound (413)."""
    srv = Server(pg_url, redis_server.url, tmp_path)
    try:
        pid = srv.proc.pid
        httpx.get(srv.url + "/dashboard/login")  # warm: templates loaded
        before = _rss_kib(pid, "VmHWM")
        streamed, took = _stream(srv.url, "/dashboard/login", 50 * 1024 * 1024)
        assert streamed.startswith(b"HTTP/1.1 413"), streamed[:200]
        declared, _ = _stream(srv.url, "/dashboard/login", 50 * 1024 * 1024, declare=300 * 1024 * 1024)
        assert declared.startswith(b"HTTP/1.1 413"), declared[:200]
        api, _ = _stream(srv.url, "/api/v1/jobs", 50 * 1024 * 1024)  # any route, signed in or not
        assert api.startswith(b"HTTP/1.1 413"), api[:200]
        growth = _rss_kib(pid, "VmHWM") - before
        assert growth < 8 * 1024, f"the server's peak RSS grew {growth} KiB for 50 MB bodies"
        # A body within the bound still reaches its route.
        from celery_lease.ops.guard import MAX_BODY_BYTES

        ok = httpx.post(srv.url + "/dashboard/login", data={"token": "x" * (MAX_BODY_BYTES - 100)})
        assert ok.status_code == 401
        line = f"issue 28, item 6: serve's peak RSS grew {growth} KiB for three 50 MB POSTs (413 after {took:.2f} s)"
        request.config.stash.setdefault(SUMMARY_LINES, []).append(line)
    finally:
        srv.stop()


@pytest.fixture
def secured(pg_url, redis_server, tmp_path):
    """A server of its own: these tests spend its budgets."""
    srv = Server(pg_url, redis_server.url, tmp_path, conf={"lease_api_rate": 2})  # bursts of 4
    yield srv
    srv.stop()


@contextlib.contextmanager
def _signed_in(srv: Server, token: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.url, timeout=30) as client:
        assert client.post("/dashboard/login", data={"token": token}).status_code == 303
        yield client


def test_the_dashboard_spends_the_tokens_request_rate(secured, pg):
    """Before: lease_api_rate throttled /api/v1 only; a signed-in token (a tenant's too)
    could hammer live.json or the payload search with no 429. Now a session spends its
    token's budget, the same one as the token's API requests."""
    with _signed_in(secured, ACME) as acme:
        started = time.monotonic()
        answers = [acme.get("/dashboard/live.json") for _ in range(16)]
        elapsed = time.monotonic() - started
        codes = [r.status_code for r in answers]
        # A burst of 4, then 2 a second: never more, however slow the host.
        assert codes[:3] == [200] * 3 and 429 in codes and codes.count(200) <= 4 + 2 * elapsed + 1, (elapsed, codes)
        limited = next(r for r in answers if r.status_code == 429)
        assert 1 <= int(limited.headers["Retry-After"]) <= 2
        # One budget: the API with the same token is spent too; another token is not.
        spent = [acme.get("/dashboard/jobs").status_code, secured.client(ACME).get("/api/v1/limits").status_code]
        assert 429 in spent, spent
        assert secured.client(GLOBEX).get("/api/v1/limits").status_code == 200
        time.sleep(1.2)
        assert acme.get("/dashboard/live.json").status_code == 200


def test_wrong_tokens_are_throttled(secured, pg):
    """Before: a wrong bearer token was never throttled: guesses ran at full speed."""
    for path in ("/api/v1/limits", "/metrics"):
        with secured.client(None) as http:
            started = time.monotonic()
            codes = [http.get(path, headers={"Authorization": f"Bearer wrong-token-{i:012d}"}).status_code for i in range(30)]
            elapsed = time.monotonic() - started
        assert codes[:10] == [401] * 10 and 429 in codes, (path, codes)  # bursts of 10
        # No faster than 5 a second after the burst, refused unread (429) beyond.
        assert codes.count(401) <= 10 + 5 * elapsed + 1, (path, elapsed, codes)
        assert set(codes) == {401, 429}
        time.sleep(2.0)  # refilled: the next path starts with a full budget
    with secured.client(ADMIN) as admin:
        assert admin.get("/api/v1/limits").status_code == 200


def test_a_proxy_is_believed_only_when_trusted(pg_url, redis_server, tmp_path):
    """Before: uvicorn believed X-Forwarded-For from any loopback peer, so each guess
    through it named a new address (never throttled), while behind a proxy elsewhere
    every user shared the proxy's bucket and never got a Secure cookie."""
    plain = Server(pg_url, redis_server.url, tmp_path)
    try:
        with httpx.Client(base_url=plain.url) as http:
            codes = [
                http.post("/dashboard/login", data={"token": "x"}, headers={"X-Forwarded-For": f"10.9.0.{i}"}).status_code
                for i in range(20)
            ]
            assert 429 in codes, codes  # one peer, one budget, whatever it claims
    finally:
        plain.stop()
    args = ("--proxy-headers", "--forwarded-allow-ips", "127.0.0.1")
    proxied = Server(pg_url, redis_server.url, tmp_path, args=args)
    try:
        with httpx.Client(base_url=proxied.url) as http:
            # Each client behind the proxy has its own budget: one locked is one locked.
            codes = [
                http.post("/dashboard/login", data={"token": "x"}, headers={"X-Forwarded-For": "10.0.0.1"}).status_code
                for _ in range(12)
            ]
            assert codes[-1] == 429, codes
            other = http.post("/dashboard/login", data={"token": ADMIN}, headers={"X-Forwarded-For": "10.0.0.2"})
            assert other.status_code == 303
            # HTTPS at the proxy: the cookie is Secure.
            secure = http.post(
                "/dashboard/login", data={"token": ADMIN}, headers={"X-Forwarded-For": "10.0.0.3", "X-Forwarded-Proto": "https"}
            )
            assert secure.status_code == 303 and "secure" in secure.headers["set-cookie"].lower()
            assert "secure" not in other.headers["set-cookie"].lower()
            # Addresses rotated (sign-ins and bearer tokens alike): the global budget holds
            # them to 20 failures a second after a burst of 40, refused unread beyond.
            started = time.monotonic()
            guess = {"Authorization": f"Bearer {'y' * 30}"}
            codes = [
                http.get("/api/v1/limits", headers={**guess, "X-Forwarded-For": f"10.2.0.{i}"}).status_code for i in range(200)
            ]
            elapsed = time.monotonic() - started
            assert 429 in codes and codes.count(401) <= 40 + 20 * elapsed + 1, (elapsed, codes)
    finally:
        proxied.stop()


def test_a_secure_cookie_can_be_required(pg_url, redis_server, tmp_path):
    srv = Server(pg_url, redis_server.url, tmp_path, conf={"lease_dashboard_secure_cookie": True})
    try:
        r = httpx.post(srv.url + "/dashboard/login", data={"token": ADMIN})
        assert r.status_code == 303 and "secure" in r.headers["set-cookie"].lower()
    finally:
        srv.stop()


def test_serve_refuses_bad_proxy_options_and_short_tokens(pg, broker):
    bad = _cli(pg, broker, "serve", "--port", "0", "--forwarded-allow-ips", "10.0.0.1")
    assert bad.returncode == 2 and "--forwarded-allow-ips needs --proxy-headers" in bad.stderr, bad.stderr
    bad = _cli(pg, broker, "serve", "--port", "0", "--proxy-headers", "--forwarded-allow-ips", "proxy.local")
    assert bad.returncode == 2 and "is not an address or network" in bad.stderr, bad.stderr
    env = {**_env(pg, broker), "CELERY_LEASE_API_TOKENS": json.dumps({"a": None})}
    short = subprocess.run(
        [CELERY, "-A", "tests.apps.app", "lease", "serve", "--port", "0"], env=env, cwd=ROOT, capture_output=True, text=True
    )
    assert short.returncode != 0 and "shorter than 20 characters" in short.stderr, short.stderr


def test_signing_out_ends_a_copied_session(server, pg):
    """Before: sign-out only asked the browser to forget its cookie; a copy kept
    working for 12 hours."""
    with _signed_in(server, ADMIN) as http:
        cookie = http.cookies["celery_lease_session"]
        csrf = re.search(r'name="csrf" value="([^"]+)"', http.get("/dashboard/jobs").text).group(1)
        assert http.post("/dashboard/logout", data={"csrf": csrf}).status_code == 303
    copy = httpx.get(server.url + "/dashboard/jobs", cookies={"celery_lease_session": cookie})
    assert copy.status_code == 303 and copy.headers["location"] == "/dashboard/login"


def test_payloads_are_shown_and_searched_only_for_tokens_that_may_read_them(server, pg, make_job):
    """Before: every token (tenant and read-only included) saw payloads on the dashboard
    and found jobs by payload values, while the API never shows a payload; and a tenant
    saw the fleet-wide rate budget of a kind."""
    job = make_job(pg, kind="ratedkind", tenant="acme", payload={"card": "4111-secret"})
    with sa.create_engine(pg).begin() as conn:
        budget = {"rate": 10, "per_seconds": 1, "rate_window": 0, "rate_claims": 0, "updated_at": sa.func.now()}
        conn.execute(limits.insert().values(kind="ratedkind", **budget))
    with _signed_in(server, ADMIN) as admin:
        assert "4111-secret" in admin.get(f"/dashboard/jobs/{job}").text
        found = admin.get("/dashboard/jobs", params={"field": "card", "value": "4111-secret"})
        assert found.status_code == 200 and job in found.text
        assert "rate-budget" in admin.get("/dashboard/kinds").text
    for token in (ACME, READER):
        with _signed_in(server, token) as other:
            page = other.get(f"/dashboard/jobs/{job}")
            # The whole value: "4111" alone turns up in a page's random CSRF token (hex)
            # about once in a few thousand pages.
            assert page.status_code == 200 and "4111-secret" not in page.text, token
            search = other.get("/dashboard/jobs", params={"field": "card", "value": "4111-secret"})
            assert search.status_code == 400 and job not in search.text, token
            assert 'name="field"' not in other.get("/dashboard/jobs").text
            bulk = other.get("/dashboard/bulk", params={"action": "cancel", "field": "card", "value": "4111-secret"})
            assert job not in bulk.text
    with _signed_in(server, ACME) as acme:
        kinds = acme.get("/dashboard/kinds")
        assert kinds.status_code == 200 and "ratedkind" in kinds.text and "rate-budget" not in kinds.text


def test_no_third_party_script_and_a_csp_on_every_response(server, pg):
    """Before: /docs and /redoc loaded Swagger UI from a CDN on the dashboard's origin,
    without sign-in or CSP."""
    with httpx.Client(base_url=server.url) as http:
        assert http.get("/docs").status_code == 404 and http.get("/redoc").status_code == 404
        assert http.get("/openapi.json").status_code == 200
        responses = [
            http.get("/openapi.json"),
            http.get("/dashboard/login"),
            http.get("/dashboard/static/dashboard.css"),
            http.get("/dashboard/nowhere"),
            http.get("/dashboard/jobs"),
            http.get("/api/v1/jobs"),
            http.get("/healthz"),
            http.post("/dashboard/login", content=b"x" * 20_000, headers={"Content-Type": "application/x-www-form-urlencoded"}),
        ]
    for r in responses:
        assert "frame-ancestors 'none'" in r.headers.get("content-security-policy", ""), (r.request.url, r.status_code)
        assert r.headers["x-frame-options"] == "DENY" and r.headers["x-content-type-options"] == "nosniff"
    assert responses[-1].status_code == 413


def test_concurrency_keys_are_labels_for_tokens_that_may_not_read_payloads(server, pg, make_job):
    """Before: a concurrency key (payload text, e.g. a customer's name) was shown to every
    token on a job's page, the Kinds and Reconciliation pages and /api/v1/limits. Now a
    token that may not read payloads sees a stable label for it there."""
    key = "cust-4111-secret"
    held = make_job(pg, kind="echo", tenant="acme", concurrency_key=key, held="limit")
    make_job(pg, kind="echo", tenant="acme", concurrency_key="cust-other", status="running")
    pages = [f"/dashboard/jobs/{held}", "/dashboard/kinds", "/dashboard/reconcile"]

    def api_keys(token: str) -> set[str | None]:
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as api:
            answer = api.get("/api/v1/limits")
        assert answer.status_code == 200 and key not in answer.text, token
        return {r["key"] for r in answer.json()["kinds"] if r["kind"] == "echo"}

    with _signed_in(server, ADMIN) as admin:
        for page in pages:
            assert key in admin.get(page).text, page
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {ADMIN}"}) as api:
        assert {r["key"] for r in api.get("/api/v1/limits").json()["kinds"] if r["kind"] == "echo"} == {key, "cust-other"}
    labels = {}
    for token in (ACME, READER):
        with _signed_in(server, token) as other:
            texts = [other.get(page).text for page in pages]
        for page, text in zip(pages, texts):
            assert key not in text, (token, page)
        shown = api_keys(token)
        # One label per key, the same on every page and route.
        assert len(shown) == 2 and all(re.fullmatch(r"key-[0-9a-f]{12}", k) for k in shown), shown
        labels[token] = shown
        for text in texts:
            assert any(label in text for label in shown)
    assert labels[ACME] == labels[READER]


# --- issue 39: the dashboard grants a token what the API grants it -------------------------


def test_the_dashboard_refuses_a_tenant_token_the_retry_the_api_refuses_it(server, pg, make_job):
    """Before: a tenant's token got 403 from POST /api/v1/jobs/{id}/retry, yet retried its
    jobs on the dashboard, one or a filter's 1,000 per POST, every round. Now the
    dashboard refuses it too and shows it no retry button; cancel (the API grants it on
    its own jobs) and delete stay; a read-only token does nothing."""
    mine = [make_job(pg, status="failed", tenant="acme", finished_at=sa.func.now()) for _ in range(2)]
    pending = make_job(pg, status="pending", tenant="acme")
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {ACME}"}, timeout=30) as api:
        assert api.post(f"/api/v1/jobs/{mine[0]}/retry").status_code == 403

    def count() -> int:
        with sa.create_engine(pg).connect() as conn:
            return conn.execute(sa.text("SELECT count(*) FROM celery_lease_jobs")).scalar_one()

    before = count()
    with _signed_in(server, ACME) as acme:
        listing_page = acme.get("/dashboard/jobs?status=failed").text
        csrf = re.search(r'name="csrf" value="([^"]+)"', listing_page).group(1)
        assert 'id="bulk-retry"' not in listing_page and 'id="bulk-cancel"' in listing_page
        job_page = acme.get(f"/dashboard/jobs/{mine[0]}").text
        assert 'id="retry"' not in job_page and 'id="delete"' in job_page
        assert acme.post(f"/dashboard/jobs/{mine[0]}/retry", data={"csrf": csrf}).status_code == 403
        assert acme.get("/dashboard/bulk?action=retry&status=failed").status_code == 403
        bulk = acme.post("/dashboard/bulk", data={"csrf": csrf, "action": "retry", "status": "failed"})
        assert bulk.status_code == 403, bulk.text
        assert acme.post(f"/dashboard/jobs/{pending}/cancel", data={"csrf": csrf}).status_code == 303
    assert count() == before
    with sa.create_engine(pg).connect() as conn:
        assert conn.execute(sa.text("SELECT status FROM celery_lease_jobs WHERE id = :j"), {"j": pending}).scalar() == "cancelled"
    with _signed_in(server, READER) as reader:
        page = reader.get(f"/dashboard/jobs/{mine[1]}").text
        csrf = re.search(r'name="csrf" value="([^"]+)"', page).group(1)
        assert 'id="retry"' not in page and 'id="bulk-retry"' not in reader.get("/dashboard/jobs").text
        assert reader.post(f"/dashboard/jobs/{mine[1]}/retry", data={"csrf": csrf}).status_code == 403
    assert count() == before
    with _signed_in(server, ADMIN) as admin:  # a token bound to no tenant retries, there as through the API
        assert 'id="retry"' in admin.get(f"/dashboard/jobs/{mine[0]}").text
        page = admin.get("/dashboard/jobs")
        assert 'id="bulk-retry"' in page.text
        csrf = re.search(r'name="csrf" value="([^"]+)"', page.text).group(1)
        # Each job once: a second round retries none of them again (retry the retries).
        for done in (2, 0):
            bulk = admin.post("/dashboard/bulk", data={"csrf": csrf, "action": "retry", "status": "failed", "tenant": "acme"})
            assert f'data-done="{done}"' in bulk.text, bulk.text
    assert count() == before + 2


# --- the dashboard's sign-in: cookies, origins, sign-in rates (issue 39) ----------------


def test_a_cookie_that_is_not_ascii_is_no_session(server, pg):
    """Before: a session cookie with a non-ASCII character (a stray byte from another
    app on the same host) made every dashboard page answer 500. Now it is no session:
    pages lead to the sign-in form, the rest is 401, as for any forged cookie."""
    for value in ("caf\u00e9.abc", "\u00e9" * 10, "abc.\u00ff\u00fe"):
        cookie = [(b"cookie", f"celery_lease_session={value}".encode())]
        with httpx.Client(base_url=server.url, timeout=30) as http:
            page = http.get("/dashboard/jobs", headers=cookie)
            assert page.status_code == 303 and page.headers["location"] == "/dashboard/login", (value, page.status_code)
            assert http.get("/dashboard/live.json", headers=cookie).status_code == 401
            assert http.post("/dashboard/logout", data={"csrf": "x"}, headers=cookie).status_code == 401


def _proxied(pg_url, redis_server, tmp_path) -> Server:
    """A server behind a trusted proxy on 127.0.0.1: X-Forwarded-For names the client."""
    return Server(pg_url, redis_server.url, tmp_path, args=("--proxy-headers", "--forwarded-allow-ips", "127.0.0.1"))


def test_a_sign_in_posted_from_another_site_is_refused(pg_url, redis_server, tmp_path, pg, make_job):
    """Before: a page of another site could auto-post its own token to the sign-in
    form and have the victim's browser signed in as the attacker's tenant. Now every
    dashboard form must come from this server's own origin (Origin, else Sec-Fetch-Site,
    else Referer); behind a TLS proxy, the origin it forwards."""
    srv = _proxied(pg_url, redis_server, tmp_path)
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            foreign = [
                {"Origin": "https://attacker.example"},
                {"Origin": "null"},  # a sandboxed frame, a data: page
                {"Origin": srv.url.replace("127.0.0.1", "localhost")},
                {"Sec-Fetch-Site": "cross-site"},
                {"Sec-Fetch-Site": "same-site"},
                {"Referer": "https://attacker.example/trap.html"},
            ]
            for headers in foreign:
                r = http.post("/dashboard/login", data={"token": ACME}, headers={**headers, "X-Forwarded-For": "10.7.0.1"})
                assert r.status_code == 403 and "set-cookie" not in r.headers, (headers, r.status_code)
            own = [
                {"Origin": srv.url},
                {"Sec-Fetch-Site": "same-origin", "Referer": srv.url + "/dashboard/login"},
                {},  # no browser headers at all: curl, a script
            ]
            for headers in own:
                r = http.post("/dashboard/login", data={"token": ACME}, headers={**headers, "X-Forwarded-For": "10.7.0.2"})
                assert r.status_code == 303 and "set-cookie" in r.headers, (headers, r.status_code)
            # Behind a TLS proxy that forwards its scheme and host (Host rewritten).
            via_proxy = {"X-Forwarded-For": "10.7.0.3", "X-Forwarded-Proto": "https", "X-Forwarded-Host": "jobs.example.com"}
            r = http.post("/dashboard/login", data={"token": ADMIN}, headers={**via_proxy, "Origin": "https://jobs.example.com"})
            assert r.status_code == 303 and "secure" in r.headers["set-cookie"].lower()
            for wrong in ("http://jobs.example.com", "https://jobs.example.com.attacker.example"):
                r = http.post("/dashboard/login", data={"token": ADMIN}, headers={**via_proxy, "Origin": wrong})
                assert r.status_code == 403, wrong
            # The other forms too, a valid CSRF token notwithstanding.
            job = make_job(pg, status="pending")
            http.cookies.clear()
            assert http.post("/dashboard/login", data={"token": ADMIN}).status_code == 303
            csrf = re.search(r'name="csrf" value="([^"]+)"', http.get("/dashboard/jobs").text).group(1)
            evil = {"Origin": "https://attacker.example"}
            assert http.post(f"/dashboard/jobs/{job}/cancel", data={"csrf": csrf}, headers=evil).status_code == 403
            assert http.post("/dashboard/logout", data={"csrf": csrf}, headers=evil).status_code == 403
            assert http.post(f"/dashboard/jobs/{job}/cancel", data={"csrf": csrf}, headers={"Origin": srv.url}).status_code == 303
    finally:
        srv.stop()


def _session_rows(pg: str) -> dict[str, int]:
    with sa.create_engine(pg).connect() as conn:
        rows = conn.execute(sa.text("SELECT token, count(*) FROM celery_lease_sessions GROUP BY token"))
        return {token: n for token, n in rows}


def test_successful_sign_ins_are_rate_limited_and_a_token_keeps_a_bounded_number_of_sessions(pg_url, redis_server, tmp_path, pg):
    """Before: a right token signed in 400 times in 1.4 s, each a 12-hour session row.
    Now one address signs in SIGN_INS_PER_ADDRESS times a minute (bursts of as many),
    and a token keeps MAX_SESSIONS_PER_TOKEN sessions: signing in past that ends its
    oldest."""
    SIGN_INS_PER_ADDRESS, MAX_SESSIONS_PER_TOKEN = 30, 50  # as docs/operations.md says
    before = _session_rows(pg)
    srv = _proxied(pg_url, redis_server, tmp_path)
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            one = {"X-Forwarded-For": "10.8.0.1"}
            answers = [http.post("/dashboard/login", data={"token": ACME}, headers=one) for _ in range(SIGN_INS_PER_ADDRESS + 10)]
            codes = [r.status_code for r in answers]
            assert codes[:SIGN_INS_PER_ADDRESS] == [303] * SIGN_INS_PER_ADDRESS and codes[-5:] == [429] * 5, codes
            assert int(answers[-1].headers["Retry-After"]) >= 1
            # Another address has its own budget; the spent one refuses a guess unread too.
            assert http.post("/dashboard/login", data={"token": ACME}, headers={"X-Forwarded-For": "10.8.0.2"}).status_code == 303
            assert http.post("/dashboard/login", data={"token": "z" * 30}, headers=one).status_code == 429
            # Sessions of one token, from many addresses: the oldest end past the cap.
            cookies = []
            for i in range(MAX_SESSIONS_PER_TOKEN + 10):
                r = http.post("/dashboard/login", data={"token": ADMIN}, headers={"X-Forwarded-For": f"10.9.0.{i}"})
                assert r.status_code == 303, (i, r.status_code)
                cookies.append(r.cookies["celery_lease_session"])
                http.cookies.clear()
        new = {token: n for token, n in _session_rows(pg).items() if token not in before}
        assert sorted(new.values()) == sorted([SIGN_INS_PER_ADDRESS + 1, MAX_SESSIONS_PER_TOKEN]), new  # ACME's, ADMIN's

        def signed_in(cookie: str) -> bool:
            return httpx.get(srv.url + "/dashboard/jobs", cookies={"celery_lease_session": cookie}).status_code == 200

        assert not signed_in(cookies[0]) and not signed_in(cookies[9])
        assert signed_in(cookies[10]) and signed_in(cookies[-1])
    finally:
        srv.stop()


def test_failures_are_counted_per_ipv6_64_and_known_addresses_pass_a_global_lockout(pg_url, redis_server, tmp_path, pg):
    """Before: each IPv6 address had a budget of its own (a host has 2^64 of them), and
    a few addresses spending the global failure budget locked every right token out.
    Now an IPv6 address counts as its /64, and an address that offered a right token
    recently (a sign-in, an API request) keeps signing in through a global lockout."""
    srv = _proxied(pg_url, redis_server, tmp_path)
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as http:

            def login(token: str, address: str) -> int:
                http.cookies.clear()
                return http.post("/dashboard/login", data={"token": token}, headers={"X-Forwarded-For": address}).status_code

            codes = [login("w" * 30, f"2001:db8:5:7::{i:x}") for i in range(1, 16)]
            assert codes[:10] == [401] * 10 and codes[-3:] == [429] * 3, codes
            assert login(ADMIN, "2001:db8:5:7:ffff::1") == 429  # the same /64
            assert login("w" * 30, "2001:db8:5:8::1") == 401  # the next one: its own budget
            assert login(ADMIN, "::ffff:10.6.0.9") == 303  # IPv4 mapped: the IPv4 address

            assert login(ADMIN, "10.6.0.1") == 303  # known from here on
            with srv.client(ADMIN) as api:
                assert api.get("/api/v1/limits", headers={"X-Forwarded-For": "10.6.0.2"}).status_code == 200
            known_passed, fresh_locked = [], []
            for round_ in range(3):
                # Guesses from ever new addresses until the global budget is spent.
                for i in range(400):
                    if login("w" * 30, f"10.{100 + round_}.{i // 200}.{i % 200}") == 429:
                        break
                else:
                    raise AssertionError("the global failure budget was never spent")
                # First (the global budget refills 20 a second): an address never seen.
                fresh_locked.append(login(ADMIN, f"10.{110 + round_}.0.1"))
                known_passed.append(login(ADMIN, "10.6.0.1"))
                bearer = {"Authorization": f"Bearer {ADMIN}", "X-Forwarded-For": "10.6.0.2"}
                known_passed.append(http.get("/api/v1/limits", headers=bearer).status_code)
            assert known_passed == [303, 200] * 3, known_passed
            assert 429 in fresh_locked, fresh_locked  # an address never seen waits it out
    finally:
        srv.stop()


def test_the_secure_cookie_can_come_from_the_environment(pg, broker, client_app, monkeypatch):
    """Before: lease_dashboard_secure_cookie came from app.conf only, so a container
    configured by its environment (docker/compose.yaml) could never require it. Now
    CELERY_LEASE_DASHBOARD_SECURE_COOKIE sets it, and a value that is no yes or no
    stops the server rather than leave the cookie as it was."""
    from fastapi.testclient import TestClient

    from celery_lease.errors import ConfigurationError
    from celery_lease.ops.api import create_app

    tokens = {"CELERY_LEASE_API_TOKENS": json.dumps({ADMIN: None})}
    for value, secure in (("true", True), ("1", True), ("false", False)):
        monkeypatch.setenv("CELERY_LEASE_DASHBOARD_SECURE_COOKIE", value)
        mod = client_app(pg, broker, extra_env=tokens)
        with TestClient(create_app(mod.leases)) as http:  # plain http://testserver
            r = http.post("/dashboard/login", data={"token": ADMIN}, follow_redirects=False)
        assert r.status_code == 303 and ("secure" in r.headers["set-cookie"].lower()) is secure, value
    monkeypatch.setenv("CELERY_LEASE_DASHBOARD_SECURE_COOKIE", "ture")
    mod = client_app(pg, broker, extra_env=tokens)
    with pytest.raises(ConfigurationError, match="CELERY_LEASE_DASHBOARD_SECURE_COOKIE must be true or false"):
        create_app(mod.leases)
    monkeypatch.delenv("CELERY_LEASE_DASHBOARD_SECURE_COOKIE")  # before client_app closes the apps
