"""The dashboard in a real browser: `celery -A tests.apps.app lease serve` as a
subprocess on a free port against the test database, headless chromium in front
(tests/e2e/browser.py). A failed test keeps a screenshot in test-artifacts/."""

from __future__ import annotations

import re
import uuid

import httpx
import pytest
import sqlalchemy as sa
from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as ec
from selenium.webdriver.support.ui import WebDriverWait

from celery_lease.db.schema import jobs, pauses
from tests.e2e.browser import chrome
from tests.integration.test_api import Server

ADMIN = "dash-admin-5e1f"
READER = "dash-reader-03ab"  # every tenant, read-only
ACME = "dash-acme-7c40"  # tenant acme only
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
    # A click that loads a page leaves the old page's elements stale: look again.
    ignored = (StaleElementReferenceException, NoSuchElementException)
    return WebDriverWait(browser, timeout, ignored_exceptions=ignored).until(condition)


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
    _wait(browser, lambda b: "kind=echo" in b.current_url)
    assert _listed(browser) == set(echo)
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
    _wait(browser, lambda b: b.find_element(By.ID, "job-status").text == "cancelled")
    assert _status(pg, echo[0]) == "cancelled"
    assert not browser.find_elements(By.ID, "cancel")  # nothing left to cancel
    # The failed job's page shows its error; searching by id opens it.
    browser.get(server.url + "/dashboard/jobs")
    browser.find_element(By.ID, "search-id").send_keys(failed + "\n")
    _wait(browser, lambda b: b.current_url.endswith(f"/dashboard/jobs/{failed}"))
    assert browser.find_element(By.ID, "job-error").text == "source table is empty"


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
    assert _status(pg, job) == "pending"
