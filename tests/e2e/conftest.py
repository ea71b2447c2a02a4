"""End-to-end tier hooks: a failed test that drove a browser keeps a screenshot of what
the browser showed, in test-artifacts/<test name>.png (see tests/harness/browser.py); the
``proxy`` fixture (a PgFaultProxy to the test database, tests/harness/pgfaults.py)."""

from __future__ import annotations

import re

import pytest
import sqlalchemy as sa

from tests.harness.pgfaults import PgFaultProxy


@pytest.fixture
def proxy(pg):
    url = sa.engine.make_url(pg)
    p = PgFaultProxy(url.host or "127.0.0.1", url.port or 5432).start()
    yield p
    p.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call" and report.failed:
        session = getattr(item, "funcargs", {}).get("browser")
        if session is not None:
            from tests.harness.browser import save_screenshot

            try:
                path = save_screenshot(session, re.sub(r"[^A-Za-z0-9_.-]", "_", item.name))
                report.sections.append(("screenshot", str(path)))
            except Exception as exc:  # a crashed browser cannot be photographed
                report.sections.append(("screenshot", f"none ({type(exc).__name__})"))
    return report
