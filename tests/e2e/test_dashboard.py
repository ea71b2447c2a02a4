"""The dashboard in a real browser: `celery -A tests.apps.app lease serve` as a
subprocess on a free port against the test database, headless chromium in front
(tests/harness/browser.py). A failed test keeps a screenshot in test-artifacts/."""

from __future__ import annotations

import contextlib
import re
import uuid

import httpx
import pytest
import sqlalchemy as sa
from selenium.common.exceptions import WebDriverException
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as ec
from selenium.webdriver.support.ui import WebDriverWait

from celery_lease.db.schema import jobs, pauses
from tests.harness.browser import chrome
from tests.harness.services import wait_for
from tests.integration.test_api import Server

ADMIN = "dash-admin-5e1f-8c2d07b4"
READER = "dash-reader-03ab-91e6f2"  # every tenant, read-only
ACME = "dash-acme-7c40-5b8e13a9"  # tenant acme only
TOKENS = {ADMIN: None, READER: {"tenant": None, "read_only": True}, ACME: "acme"}


@pytest.fixture(scope="module")
def server(pg_url, redis_server, tmp_path_factory):
    srv = Server(pg_url, redis_server.url, tmp_path_factory.mktemp("dashboard"), tokens=TOKENS)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def _chrome():
    session = chrome()
    yield session
    session.quit()


@pytest.fixture
def browser(_chrome, server):
    """The module's browser, signed out."""
    _chrome.get(server.url + "/dashboard/login")
    _chrome.delete_all_cookies()
    return _chrome


def _wait(browser, condition, timeout: float = 10):
    # A click that loads a page leaves the old page's elements stale: look again. Chromium
    # does not always say "stale": a node read while the new document replaces the old one
    # fails as a plain WebDriverException ("Node with given id does not belong to the
    # document", CI run of 2026-12-02), the base class of the stale and missing errors.
    return WebDriverWait(browser, timeout, ignored_exceptions=(WebDriverException,)).until(condition)


def sign_in(browser, server, token: str) -> None:
    browser.get(server.url + "/dashboard/jobs")
    # Not signed in: every page leads to the form, whose one field is `token`.
    _wait(browser, ec.presence_of_element_located((By.NAME, "token")))
    assert browser.current_url.endswith("/dashboard/login")
    browser.find_element(By.NAME, "token").send_keys(token)
    browser.find_element(By.ID, "sign-in").click()
    _wait(browser, ec.presence_of_element_located((By.ID, "jobs")))


def _status(db: str, job_id: str) -> str:
    with sa.create_engine(db).connect() as conn:
        return conn.execute(sa.select(jobs.c.status).where(jobs.c.id == job_id)).scalar_one()


def _listed(browser) -> set[str]:
    return {row.get_attribute("data-job-id") for row in browser.find_elements(By.CSS_SELECTOR, "#jobs tbody tr[data-job-id]")}


def test_sign_in_filter_open_a_job_and_cancel_it(browser, server, pg, make_job):
    echo = [make_job(pg, kind="echo", payload={"table": f"t{i}"}) for i in range(3)]
    steps = make_job(pg, kind="steps", task="tests.apps.app.steps", payload={"table": "users<b>"})
    failed = make_job(pg, kind="echo", status="failed", attempt=3, error="source table is empty", finished_at=sa.func.now())

    sign_in(browser, server, ADMIN)
    assert _listed(browser) == {*echo, steps, failed}
    # Counts per kind: two kinds, their pending jobs.
    counts = browser.find_element(By.ID, "counts").text
    assert "echo" in counts and "steps" in counts

    # Filter by kind and status: only the pending echo jobs remain.
    browser.find_element(By.ID, "f-kind").send_keys("echo")
    browser.find_element(By.CSS_SELECTOR, "#f-status option:nth-child(2)").click()  # pending
    browser.find_element(By.ID, "apply-filter").click()
    _wait(browser, lambda b: "kind=echo" in b.current_url and _listed(b) == set(echo))
    # A payload field search.
    browser.get(server.url + "/dashboard/jobs?field=table&value=users%3Cb%3E")
    assert _listed(browser) == {steps}

    # Open a job from the list: its page is a /dashboard URL with its id.
    browser.get(server.url + "/dashboard/jobs?kind=echo&status=pending")
    browser.find_element(By.CSS_SELECTOR, f"tr[data-job-id='{echo[0]}'] a").click()
    _wait(browser, ec.presence_of_element_located((By.ID, "job-status")))
    assert re.search(rf"/dashboard/jobs/{echo[0]}$", browser.current_url)
    assert browser.find_element(By.ID, "job-status").text == "pending"
    assert '"table": "t0"' in browser.find_element(By.ID, "job-payload").text

    browser.find_element(By.ID, "cancel").click()
    # Cancel asks first; nothing is cancelled until the confirmation's button.
    _wait(browser, ec.presence_of_element_located((By.ID, "confirm")))
    assert _status(pg, echo[0]) == "pending"
    browser.find_element(By.ID, "confirm").click()
    _wait(browser, lambda b: b.find_element(By.ID, "job-status").text == "cancelled")
    assert _status(pg, echo[0]) == "cancelled"
    assert not browser.find_elements(By.ID, "cancel")  # nothing left to cancel
    # The failed job's page shows its error; searching by id opens it.
    browser.get(server.url + "/dashboard/jobs")
    browser.find_element(By.ID, "search-id").send_keys(failed + "\n")
    _wait(browser, lambda b: b.current_url.endswith(f"/dashboard/jobs/{failed}"))
    _wait(browser, lambda b: b.find_element(By.ID, "job-error").text == "source table is empty")


def test_pause_and_resume_a_kind(browser, server, pg, make_job):
    make_job(pg, kind="echo")
    sign_in(browser, server, ADMIN)
    browser.get(server.url + "/dashboard/kinds")
    row = browser.find_element(By.CSS_SELECTOR, "#kinds tr[data-kind='echo']")
    assert row.find_element(By.CLASS_NAME, "kind-state").text == "active"
    row.find_element(By.CLASS_NAME, "kind-action").click()
    _wait(browser, lambda b: b.find_element(By.CSS_SELECTOR, "#kinds tr[data-kind='echo'] .kind-state").text == "paused")
    with sa.create_engine(pg).connect() as conn:
        assert conn.execute(sa.select(pauses.c.kind)).scalars().all() == ["echo"]
    browser.find_element(By.CSS_SELECTOR, "#kinds tr[data-kind='echo'] .kind-action").click()
    _wait(browser, lambda b: b.find_element(By.CSS_SELECTOR, "#kinds tr[data-kind='echo'] .kind-state").text == "active")
    with sa.create_engine(pg).connect() as conn:
        assert conn.execute(sa.select(pauses.c.kind)).scalars().all() == []


def test_a_read_only_token_sees_jobs_but_no_action(browser, server, pg, make_job):
    job = make_job(pg, kind="echo")
    done = make_job(pg, kind="echo", status="failed", finished_at=sa.func.now())
    sign_in(browser, server, READER)
    assert browser.find_element(By.ID, "read-only").is_displayed()
    assert _listed(browser) == {job, done}
    assert not browser.find_elements(By.ID, "bulk-actions")
    for target in (job, done):
        browser.get(f"{server.url}/dashboard/jobs/{target}")
        assert browser.find_element(By.ID, "job-status").text in ("pending", "failed")
        assert not browser.find_elements(By.CSS_SELECTOR, "#job-actions button, main form button")
    browser.get(server.url + "/dashboard/kinds")
    assert not browser.find_elements(By.CLASS_NAME, "kind-action")
    # A forged POST with the session's own CSRF token is still refused, and changes nothing.
    with httpx.Client(base_url=server.url) as http:
        http.post("/dashboard/login", data={"token": READER})
        page = http.get(f"/dashboard/jobs/{job}").text
        csrf = re.search(r'name="csrf" value="([^"]+)"', page).group(1)
        assert http.post(f"/dashboard/jobs/{job}/cancel", data={"csrf": csrf}).status_code == 403
        assert http.post("/dashboard/kinds/echo/pause", data={"csrf": csrf}).status_code == 403
    assert _status(pg, job) == "pending"


def test_a_tenant_token_sees_only_its_tenant(browser, server, pg, make_job):
    mine = make_job(pg, kind="echo", tenant="acme")
    other = make_job(pg, kind="echo", tenant="globex")
    untenanted = make_job(pg, kind="echo")
    sign_in(browser, server, ACME)
    assert browser.find_element(By.ID, "viewer-tenant").text == "acme"
    assert _listed(browser) == {mine}
    browser.get(server.url + "/dashboard/jobs?tenant=globex")  # the filter cannot widen it
    assert _listed(browser) == {mine}
    for hidden in (other, untenanted, str(uuid.uuid4())):
        browser.get(f"{server.url}/dashboard/jobs/{hidden}")
        assert browser.find_element(By.TAG_NAME, "h1").text == "no such job"
    browser.get(f"{server.url}/dashboard/jobs/{mine}")
    assert browser.find_element(By.ID, "job-status").text == "pending"
    # Kinds and the broker are shared by every tenant: a tenant's token steers neither.
    browser.get(server.url + "/dashboard/kinds")
    assert not browser.find_elements(By.CLASS_NAME, "kind-action")
    with _session(server, ACME) as http:
        token = _csrf(http)
        assert http.post("/dashboard/kinds/echo/pause", data={"csrf": token}).status_code == 403
        assert http.post("/dashboard/reconcile/sweep", data={"csrf": token}).status_code == 403
        assert http.post(f"/dashboard/jobs/{other}/cancel", data={"csrf": token}).status_code == 404
        assert http.get("/dashboard/bulk?action=cancel&tenant=globex").text.count('data-count="1"') == 1  # its own job only
    assert _row(pg, other)["status"] == "pending"
    with sa.create_engine(pg).connect() as conn:
        assert conn.execute(sa.select(pauses.c.kind)).scalars().all() == []


def test_nothing_is_served_without_signing_in(server, pg, make_job):
    job = make_job(pg, kind="echo")
    pages = ["/dashboard/", "/dashboard/jobs", f"/dashboard/jobs/{job}", "/dashboard/kinds", "/dashboard/live"]
    pages += ["/dashboard/workers", "/dashboard/reconcile", "/dashboard/bulk?action=cancel"]
    with httpx.Client(base_url=server.url) as http:
        for page in pages:
            r = http.get(page)
            assert r.status_code == 303 and r.headers["location"] == "/dashboard/login", page
        assert http.get("/dashboard/live.json").status_code == 401
        for action in (f"/dashboard/jobs/{job}/cancel", "/dashboard/kinds/echo/pause", "/dashboard/reconcile/sweep"):
            assert http.post(action, data={"csrf": "x"}).status_code == 401, action
        # A forged or tampered cookie is no session either.
        http.cookies.set("celery_lease_session", "e30.AAAA", path="/dashboard")
        assert http.get("/dashboard/jobs").status_code == 303
        assert http.post("/dashboard/login", data={"token": "not-a-token"}).status_code == 401
        # Guessing tokens on the form is throttled per address (5 a second, bursts of 10).
        answers = [http.post("/dashboard/login", data={"token": f"guess-{i}"}) for i in range(30)]
        assert {r.status_code for r in answers} == {401, 429}
        assert int(next(r for r in answers if r.status_code == 429).headers["Retry-After"]) >= 1
        wait_for(lambda: http.post("/dashboard/login", data={"token": "x"}).status_code == 401, what="the throttle to refill")
    assert _status(pg, job) == "pending"


# --- through HTTP with a signed-in session: what real workers leave, and the actions --------


@contextlib.contextmanager
def _session(server, token: str = ADMIN):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        assert client.post("/dashboard/login", data={"token": token}).status_code == 303
        yield client


def _csrf(client: httpx.Client) -> str:
    return re.search(r'name="csrf" value="([^"]+)"', client.get("/dashboard/jobs").text).group(1)


def _row(db: str, job_id: str) -> dict | None:
    with sa.create_engine(db).connect() as conn:
        row = conn.execute(sa.select(jobs).where(jobs.c.id == job_id)).mappings().first()
        return None if row is None else dict(row)


def _queued(broker: str, queue: str = "celery") -> list[str]:
    """The job ids of the wakeups waiting in a Redis queue."""
    import json

    import redis

    client = redis.Redis.from_url(broker)
    try:
        return [json.loads(m)["headers"]["id"] for m in client.lrange(queue, 0, -1)]
    finally:
        client.close()


def test_a_job_run_by_a_worker_shows_its_attempts_and_live_figures(server, pg, broker, client_app, workers):
    mod = client_app(pg, broker)
    run = str(uuid.uuid4())
    job = mod.flaky.submit({"ok_at": 2}, run_id=run)  # attempt 1 raises (retried), attempt 2 succeeds
    workers(pg, broker, name="dash")

    def finished() -> bool:
        mod.leases.sweep()  # what beat does: wakes the retry when its backoff is over
        return mod.leases.get(job.id).terminal

    wait_for(finished, timeout=60, interval=0.3, what="the flaky job to finish")
    assert mod.leases.get(job.id).status.value == "succeeded"
    with _session(server) as http:
        page = http.get(f"/dashboard/jobs/{job.id}").text
        attempts = re.search(r'<table id="attempts">(.*?)</table>', page, re.S).group(1)
        rows = re.findall(r'data-outcome="(\w+)"><td>(\d+)</td><td class="mono worker">([^<]*)</td>', attempts)
        assert [(n, outcome) for outcome, n, _ in rows] == [("1", "retried"), ("2", "succeeded")]
        assert all(worker.startswith("dash@testhost/") for _, _, worker in rows)
        assert "hunter2" not in page  # the exception's text never reaches the table, nor the page
        assert page.count('<tr class="this">') >= 4  # dispatched, claimed, retried, claimed, succeeded
        live = http.get("/dashboard/live.json").json()
        (flaky,) = [k for k in live["kinds"] if k["kind"] == "flaky"]
        assert sum(flaky["submitted"]) == 1 and sum(flaky["succeeded"]) == 1 and sum(flaky["failed"]) == 0
        assert flaky["run_p50"] is not None and flaky["wait_p50"] >= 0
        counts = re.search(r'<table id="counts">(.*?)</table>', http.get("/dashboard/jobs").text, re.S).group(1)
        assert re.search(r"flaky</a></td>.*?s-succeeded\"><a [^>]*>1</a>", counts, re.S)


def test_cancelling_one_job_asks_for_confirmation_first(server, pg, make_job):
    job = make_job(pg, status="running", attempt=1, lease_owner="w1@h/1/b")
    with _session(server) as http:
        page = http.get(f"/dashboard/jobs/{job}").text
        # The job page's Cancel only asks (a GET, no script under the CSP).
        assert re.search(
            rf'<form method="get" action="/dashboard/jobs/{job}/cancel"[^>]*><button type="submit" id="cancel">', page
        )
        confirm = http.get(f"/dashboard/jobs/{job}/cancel")
        assert confirm.status_code == 200 and 'id="confirm"' in confirm.text and "final" in confirm.text
        assert re.search(rf'<form method="post" action="/dashboard/jobs/{job}/cancel">', confirm.text)
        assert _row(pg, job)["status"] == "running"  # asking changed nothing
        token = _csrf(http)
        assert http.post(f"/dashboard/jobs/{job}/cancel", data={"csrf": token}).status_code == 303
        assert _row(pg, job)["status"] == "cancelled"
        # Nothing left to cancel: back to the job's page.
        again = http.get(f"/dashboard/jobs/{job}/cancel")
        assert again.status_code == 303 and again.headers["location"] == f"/dashboard/jobs/{job}"
    pending = make_job(pg, status="pending")
    with _session(server, READER) as reader:
        assert reader.get(f"/dashboard/jobs/{pending}/cancel").status_code == 403
    assert _row(pg, pending)["status"] == "pending"


def test_retry_makes_a_new_job_and_delete_removes_a_finished_one(server, pg, broker, make_job):
    run = str(uuid.uuid4())
    failed = make_job(
        pg, status="failed", attempt=3, error="boom", payload={"table": "t1"}, run_id=run, finished_at=sa.func.now()
    )
    pending = make_job(pg, status="pending")
    with _session(server) as http:
        token = _csrf(http)
        r = http.post(f"/dashboard/jobs/{failed}/retry", data={"csrf": token})
        assert r.status_code == 303
        new = r.headers["location"].rsplit("/", 1)[1]
        assert new != failed
        row = _row(pg, new)
        assert (row["status"], row["attempt"], row["parent_id"], row["run_id"]) == ("pending", 0, failed, run)
        assert (row["payload"], row["kind"], row["max_attempts"]) == ({"table": "t1"}, "echo", 3)
        assert _row(pg, failed)["status"] == "failed"  # a finished job never changes
        assert new in _queued(broker)  # woken at once
        assert "retry of" in http.get(f"/dashboard/jobs/{new}").text  # its dispatched event
        # Only a failed, expired or cancelled job is retried.
        assert http.post(f"/dashboard/jobs/{pending}/retry", data={"csrf": token}).status_code == 409
        # Delete: a finished job and its events; a pending one must be cancelled first.
        assert http.post(f"/dashboard/jobs/{failed}/delete", data={"csrf": token}).status_code == 303
        assert _row(pg, failed) is None
        with sa.create_engine(pg).connect() as conn:
            assert (
                conn.execute(sa.text("SELECT count(*) FROM celery_lease_events WHERE job_id = :j"), {"j": failed}).scalar() == 0
            )
        assert http.post(f"/dashboard/jobs/{pending}/delete", data={"csrf": token}).status_code == 409
        assert _row(pg, pending)["status"] == "pending"
        # Without the session's CSRF token (or with another session's), nothing happens.
        with _session(server) as other:
            stolen = _csrf(other)
        for data in ({"other": "1"}, {"csrf": ""}, {"csrf": stolen}):
            assert http.post(f"/dashboard/jobs/{pending}/cancel", data=data).status_code == 403
        assert _row(pg, pending)["status"] == "pending"


def test_bulk_cancel_confirms_the_count_then_cancels_what_the_filter_matches(server, pg, make_job):
    echo = [make_job(pg, kind="echo") for _ in range(3)]
    steps = [make_job(pg, kind="steps", task="tests.apps.app.steps") for _ in range(2)]
    done = make_job(pg, kind="echo", status="succeeded", finished_at=sa.func.now())
    with _session(server) as http:
        confirm = http.get("/dashboard/bulk?action=cancel&kind=echo").text
        assert 'data-count="3"' in confirm
        assert all(_row(pg, j)["status"] == "pending" for j in echo)  # confirming changes nothing
        token = _csrf(http)
        r = http.post("/dashboard/bulk", data={"csrf": token, "action": "cancel", "kind": "echo"})
        assert 'data-done="3"' in r.text
    assert [_row(pg, j)["status"] for j in echo] == ["cancelled"] * 3
    assert [_row(pg, j)["status"] for j in steps] == ["pending"] * 2
    assert _row(pg, done)["status"] == "succeeded"


def test_reconciliation_shows_the_broker_beside_the_table_and_resends_wakeups(server, pg, broker, client_app, make_job):
    mod = client_app(pg, broker, conf={"lease_coalesce_wakeups": False})  # a wakeup per job, to count
    waiting = mod.echo.submit({})
    gone = mod.echo.submit({})
    mod.leases.cancel(gone.id)  # its wakeup stays in Redis: it wakes a finished job
    assert set(_queued(broker)) == {waiting.id, gone.id}
    lost = make_job(pg, kind="echo", woken_at=None)  # committed, but its wakeup never sent
    with _session(server) as http:
        page = http.get("/dashboard/reconcile").text
        queue = re.search(r"<tr><td>celery</td>(.*?)</tr>", page, re.S).group(1)
        cells = re.findall(r'<td class="num">([^<]*)</td>', queue)
        assert cells == ["2", "0", "2", "1 of 2"]  # pending rows, held rows, in Redis, waking a finished job
        stale = re.search(r'<table id="stale">(.*?)</table>', page, re.S).group(1)
        assert lost[:8] in stale and waiting.id[:8] not in stale
        r = http.post("/dashboard/reconcile/sweep", data={"csrf": _csrf(http)})
        assert r.status_code == 303 and "sent=" in r.headers["location"]
    assert lost in _queued(broker)
    assert _row(pg, lost)["woken_at"] is not None


def test_a_routed_job_is_shown_filtered_and_reconciled_on_its_queue(server, pg, broker, client_app, make_job):
    mod = client_app(pg, broker, conf={"task_routes": {"tests.apps.app.echo": {"queue": "routed"}}})
    routed = mod.echo.submit({})
    other = make_job(pg, kind="echo", queue=None)  # stored before routing was recorded
    assert _queued(broker, "routed") == [routed.id]
    with _session(server) as http:
        page = http.get("/dashboard/reconcile").text
        queue = re.search(r"<tr><td>routed</td>(.*?)</tr>", page, re.S).group(1)
        assert re.findall(r'<td class="num">([^<]*)</td>', queue) == ["1", "0", "1", "0 of 1"]
        listed = http.get("/dashboard/jobs", params={"queue": "routed"}).text
        assert routed.id in listed and other not in listed
    with server.client(ADMIN) as api:
        assert api.get(f"/api/v1/jobs/{routed.id}").json()["queue"] == "routed"
        assert [j["id"] for j in api.get("/api/v1/jobs", params={"queue": "routed"}).json()["jobs"]] == [routed.id]


def test_the_live_page_updates_without_a_reload(browser, server, pg, make_job):
    make_job(pg, kind="echo", status="succeeded", attempt=1, started_at=sa.func.now(), finished_at=sa.func.now())
    sign_in(browser, server, ADMIN)
    browser.get(server.url + "/dashboard/live")
    row = "#live tr[data-kind='echo']"
    _wait(browser, ec.presence_of_element_located((By.CSS_SELECTOR, row)))
    cells = browser.find_elements(By.CSS_SELECTOR, f"{row} td")
    assert cells[2].text.endswith(" 1")  # succeeded in the window
    browser.execute_script("window.notReloaded = true")
    make_job(pg, kind="echo", status="succeeded", attempt=1, started_at=sa.func.now(), finished_at=sa.func.now())
    # The script polls live.json every 5 s and redraws the table in place.
    _wait(browser, lambda b: b.find_elements(By.CSS_SELECTOR, f"{row} td")[2].text.endswith(" 2"), timeout=15)
    assert browser.execute_script("return window.notReloaded") is True


def test_the_workers_page_shows_leases_about_to_lapse(server, pg, make_job):
    def lease(owner: str, seconds_left: int) -> str:
        expires = sa.func.now() + sa.text(f"interval '{seconds_left} seconds'")
        return make_job(
            pg,
            status="running",
            attempt=1,
            lease_owner=owner,
            lease_seconds=30,
            lease_expires_at=expires,
            started_at=sa.func.now(),
        )

    fresh, lapsing, lapsed = lease("w1@h/10/b", 28), lease("w1@h/10/b", 5), lease("w2@h/20/b", -3)
    with _session(server) as http:
        page = http.get("/dashboard/workers").text
    owners = re.search(r'<table id="owners">(.*?)</table>', page, re.S).group(1)
    assert re.search(r"<td>w1@h</td><td>10</td>.*?<td class=\"num\">2</td>", owners, re.S)
    assert re.search(r"<td>w2@h</td><td>20</td>.*?<td class=\"num\">1</td>", owners, re.S)
    found = re.findall(r'<tr class="lease-(\w+)"><td class="id"><a href="/dashboard/jobs/([0-9a-f-]+)"', page)
    # Soonest to lapse first.
    assert [(job, state) for state, job in found] == [(lapsed, "lapsed"), (lapsing, "lapsing"), (fresh, "ok")]


def test_the_kinds_page_shows_a_rate_budget(server, pg):
    from celery_lease.db.schema import limits

    with sa.create_engine(pg).begin() as conn:
        window = conn.execute(sa.text("SELECT floor(extract(epoch from now()) / 3600)::bigint")).scalar_one()
        row = {"kind": "echo", "rate": 20, "per_seconds": 3600, "rate_claims": 7, "updated_at": sa.func.now()}
        conn.execute(limits.insert().values(**row, rate_window=window))
        conn.execute(limits.insert().values(**{**row, "kind": "steps"}, rate_window=window - 1))  # an older window
    with _session(server) as http:
        page = http.get("/dashboard/kinds").text
    # (Within one row: every declared kind has a row now, most without a budget.)
    budgets = dict(re.findall(r'<tr data-kind="(\w+)">(?:(?!</tr>).)*?rate-budget">([^<]*)<', page, re.S))
    assert budgets == {"echo": "7 of 20 used this window", "steps": "0 of 20 used this window"}


def test_changing_a_kinds_concurrency_on_the_kinds_page_binds_the_running_fleet(
    browser, pg, broker, client_app, workers, tmp_path
):
    """The Kinds page's limits form, in the browser, against two running workers of
    app_flow: limited2 declares concurrency 2 in code; set to 1 on the page, the fleet
    never runs two of its bodies at once again; 'default' brings back the code's 2."""
    from celery_lease.db.schema import limits
    from tests.apps.app_flow import flow_metadata, spans
    from tests.e2e.test_flow import max_overlap

    module = "tests.apps.app_flow"
    engine = sa.create_engine(pg)
    flow_metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(spans.delete())
    srv = Server(pg, broker, tmp_path, tokens=TOKENS, module=module)
    try:
        mod = client_app(pg, broker, module=module)
        for name in ("k1", "k2"):
            workers(pg, broker, name=name, module=module, concurrency=2)
        sign_in(browser, srv, ADMIN)
        browser.get(srv.url + "/dashboard/kinds")

        def cell(kind: str, what: str):
            return browser.find_element(By.CSS_SELECTOR, f"#kinds tr[data-kind='{kind}'] .{what}")

        # Idle kinds are listed too, each limit with where it comes from.
        assert (cell("limited2", "kind-concurrency").text, cell("limited2", "kind-concurrency").get_attribute("data-source")) == (
            "2",
            "code",
        )
        assert cell("unlimited", "kind-concurrency").text == ""

        def bodies(ids: list[str]) -> list[dict]:
            with engine.connect() as conn:
                return [dict(r) for r in conn.execute(sa.select(spans).where(spans.c.job_id.in_(ids))).mappings()]

        def run(n: int) -> list[dict]:
            ids = [j.id for j in mod.limited2.submit_many([{"sleep": 0.4}] * n)]
            wait_for(lambda: all(j.terminal for j in map(mod.leases.get, ids)), timeout=60, what=f"{n} limited2 jobs")
            return bodies(ids)

        assert max_overlap(run(4)) == 2  # the code's limit
        form = browser.find_element(By.CSS_SELECTOR, "#kinds tr[data-kind='limited2'] form.kind-limits")
        form.find_element(By.NAME, "concurrency").send_keys("1")
        form.find_element(By.CLASS_NAME, "kind-set-limits").click()
        _wait(browser, lambda b: cell("limited2", "kind-concurrency").get_attribute("data-source") == "override")
        assert cell("limited2", "kind-concurrency").text == "1"
        assert "concurrency: override" in cell("limited2", "limit-source").text
        with engine.connect() as conn:
            assert conn.execute(sa.select(limits.c.concurrency_override).where(limits.c.kind == "limited2")).scalar() == 1
        assert max_overlap(run(5)) == 1  # the running workers obey the page at once
        form = browser.find_element(By.CSS_SELECTOR, "#kinds tr[data-kind='limited2'] form.kind-limits")
        form.find_element(By.NAME, "concurrency").send_keys("default")
        form.find_element(By.CLASS_NAME, "kind-set-limits").click()
        _wait(browser, lambda b: cell("limited2", "kind-concurrency").get_attribute("data-source") == "code")
        assert max_overlap(run(4)) == 2
        # Bad input: an error page that says what is wrong, and nothing changed.
        browser.get(srv.url + "/dashboard/kinds")
        form = browser.find_element(By.CSS_SELECTOR, "#kinds tr[data-kind='limited2'] form.kind-limits")
        form.find_element(By.NAME, "concurrency").send_keys("0")
        form.find_element(By.CLASS_NAME, "kind-set-limits").click()
        _wait(browser, lambda b: "concurrency must be" in b.page_source)
        with engine.connect() as conn:
            assert conn.execute(sa.select(limits.c.concurrency_override).where(limits.c.kind == "limited2")).scalar() is None
    finally:
        srv.stop()
        engine.dispose()


def test_the_kinds_page_shows_each_tenants_share_beside_its_weight_and_an_admin_sets_it(server, pg, make_job):
    from celery_lease.db.schema import tenant_weights

    for tenant, n in (("acme", 3), ("globex", 1)):
        for i in range(n):
            make_job(pg, tenant=tenant, fair_key=float(i + 1))
    with _session(server, ADMIN) as http:
        token = _csrf(http)
        assert http.post("/dashboard/tenants/acme/weight", data={"csrf": token, "weight": "3"}).status_code == 303
        page = http.get("/dashboard/kinds").text
        acme = re.search(r'<tr data-tenant="acme">(.*?)</tr>', page, re.S).group(1)
        assert re.search(r'tenant-weight">3\b', acme) and 'tenant-share">75%' in acme, acme
        assert 'tenant-share">25%' in re.search(r'<tr data-tenant="globex">(.*?)</tr>', page, re.S).group(1)
        for bad in ("0", "-1", "lots", ""):
            r = http.post("/dashboard/tenants/acme/weight", data={"csrf": token, "weight": bad})
            assert r.status_code == 400 and "weight must be" in r.text, bad
    with _session(server, ACME) as http:  # a tenant's token: its own row, and no form
        page = http.get("/dashboard/kinds").text
        assert 'data-tenant="acme"' in page and 'data-tenant="globex"' not in page and "tenant-set-weight" not in page
        assert http.post("/dashboard/tenants/acme/weight", data={"csrf": _csrf(http), "weight": "9"}).status_code == 403
    with sa.create_engine(pg).connect() as conn:
        assert conn.execute(sa.select(tenant_weights.c.tenant, tenant_weights.c.weight)).all() == [("acme", 3.0)]
