"""Debian's Chromium driven by Playwright, for the dashboard and report tests (`browser` marker).

Playwright's own browser download cannot run here, so it launches `/usr/bin/chromium` (Debian's package,
installed by `make sysdeps`) through `executable_path`, with the flags that keep it off the network.
A missing browser fails the test with the fix; it never skips (CI installs it).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

CHROMIUM_ENV = "RLDIAG_CHROMIUM"  # override the browser binary (default: Debian's /usr/bin/chromium)
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"  # screenshots land here (gitignored)


def chromium_path() -> str:
    path = os.environ.get(CHROMIUM_ENV) or shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(path).exists():
        pytest.fail(f"no Chromium at {path}: install Debian's package with `sudo make sysdeps` "
                    f"(or point {CHROMIUM_ENV} at a Chromium binary)", pytrace=False)
    return path


@contextmanager
def chromium() -> Iterator[object]:
    """A headless Chromium (a Playwright `Browser`)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the browser tests need Playwright: pip install -e '.[dev]' (make test does it)", pytrace=False)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), headless=True, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def screenshot(page, name: str) -> Path:
    """Save a full-page PNG under tests/artifacts/ and return its path."""
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path
