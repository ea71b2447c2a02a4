"""``python -m bench screenshot [--out PATH]``: the README's picture of the jobs page.

Seeds a throwaway PostgreSQL database with the dashboard bench's demo data (5,000
jobs finished over 12 hours and 40 live ones, see bench.dashboard), serves the dashboard on a free
port, signs in with headless chromium (tests/harness/browser.py) and saves the jobs page
to docs/img/jobs.png.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from bench import harness
from bench.dashboard import ADMIN, Serving, make_app, seed


def main(args, log) -> int:
    from selenium.webdriver.common.by import By

    from tests.harness.browser import chrome

    dbs = harness.Databases()
    with tempfile.TemporaryDirectory(prefix="celery-lease-shot-") as tmp:
        redis = harness.RedisServer(Path(tmp))
        redis.start()
        try:
            url = dbs.create("screenshot")
            app, leases = make_app(url, redis.url)
            leases.create_schema()
            seed(url, 5000, log, days=0.5, live=40)
            serving = Serving(leases)
            browser = chrome(width=1400, height=1050)
            try:
                browser.get(serving.url + "/dashboard/login")
                browser.find_element(By.NAME, "token").send_keys(ADMIN)
                browser.find_element(By.ID, "sign-in").click()
                browser.find_element(By.ID, "jobs")
                args.out.parent.mkdir(parents=True, exist_ok=True)
                browser.save_screenshot(str(args.out))
            finally:
                browser.quit()
                serving.stop()
            leases.store.dispose()
            app.close()
        finally:
            redis.stop()
            dbs.close()
    log(f"wrote {args.out}")
    return 0
