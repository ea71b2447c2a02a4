"""A real browser for the dashboard's tests: Debian's headless chromium driven through
chromedriver by selenium (`bash dev.sh test` installs both where missing).

Nothing is downloaded: the driver and browser binaries are given explicitly, so
selenium's own driver manager never reaches the network.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: Screenshots of failed browser tests (git-ignored).
ARTIFACTS = ROOT / "test-artifacts"


def _binary(*names: str) -> str | None:
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    return None


def chrome(width: int = 1400, height: int = 1000):
    """A headless chromium session; the caller quits it."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser = _binary("chromium", "chromium-browser")
    driver = _binary("chromedriver")
    if browser is None or driver is None:
        pytest.fail("the browser tests need chromium and chromium-driver: run `bash dev.sh test` (it installs them)")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in (
        "--headless=new",
        "--no-sandbox",  # the tests may run as root in a container
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--disable-extensions",
        "--no-first-run",
        f"--window-size={width},{height}",
    ):
        options.add_argument(arg)
    session = webdriver.Chrome(service=Service(executable_path=driver), options=options)
    session.set_page_load_timeout(30)
    return session


def save_screenshot(session, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    session.save_screenshot(str(path))
    return path
