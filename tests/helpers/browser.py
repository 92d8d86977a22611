"""Debian's Chromium driven by Playwright, for the dashboard and report tests (`browser` marker).

Playwright's own browser download cannot run here, so it launches `/usr/bin/chromium` (Debian's package,
installed by `make sysdeps`) through `executable_path`, with the flags that keep it off the network.
A missing browser fails the test with the fix; it never skips (CI installs it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.helpers.net import start_dashboard

CHROMIUM_ENV = "RLDIAG_CHROMIUM"  # override the browser binary (default: Debian's /usr/bin/chromium)
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"  # tests/artifacts: screenshots land here (gitignored)


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


def drawn_panels_js(fields: str = "name: t.name, x: Array.from(t.x || [])") -> str:
    """JS for `page.evaluate`: every plotly panel drawn on the page, `[{title, traces: [{<fields>}]}]`,
    with `fields` an object literal's body over a trace `t` (plotly's `_fullData`). A panel is titled by
    an annotation over its x axis ("x3 domain": the Compare grid, app/dashboard/grid_figure.py), a
    one-panel chart by its title."""
    return f"""() => [...document.querySelectorAll('.js-plotly-plot')].filter(p => p._fullData).flatMap(p => {{
    const titled = (p._fullLayout.annotations || []).filter(a => / domain$/.test(a.xref));
    const panels = titled.length ? titled.map(a => [a.xref.split(' ')[0], a.text]) : [['x', p._fullLayout.title.text]];
    return panels.map(([axis, title]) => ({{title, traces: p._fullData.filter(t => (t.xaxis || 'x') === axis)
        .map(t => ({{{fields}}}))}}));
}})"""


# Every panel drawn: its title and, per trace, the name plotly shows and the x it drew.
DRAWN_JS = drawn_panels_js()


def screenshot(page, name: str) -> Path:
    """Save a full-page PNG under tests/artifacts/ and return its path."""
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


# The dashboard's page is connected and its script has run to the end.
READY = ('[data-testid="stApp"][data-test-connection-state="CONNECTED"]'
         '[data-test-script-state="notRunning"]')


def serve(uri: str, tmp_path: Path) -> tuple[subprocess.Popen, str, Path]:
    """`rldiag app` on a free port in its own process group; returns once /_stcore/health says ok."""
    log = tmp_path / "rldiag.app.log"
    try:
        proc, url, _ = start_dashboard(uri, log)
    except RuntimeError as e:
        pytest.fail(str(e))
    return proc, url, log


def drawn(page, wanted: dict[str, set[str]], timeout_s: float = 240) -> dict[str, dict[str, list]]:
    """Wait until each chart title in `wanted` is drawn holding (at least) those trace names."""
    deadline = time.monotonic() + timeout_s
    while True:
        charts = {c["title"]: {t["name"]: t["x"] for t in c["traces"]} for c in page.evaluate(DRAWN_JS)}
        if all(title in charts and names <= set(charts[title]) for title, names in wanted.items()):
            return charts
        if time.monotonic() > deadline:
            pytest.fail(f"charts not drawn as expected after {timeout_s} s: have {{title: names}} = "
                        f"{ {k: sorted(v) for k, v in charts.items()} }")
        page.wait_for_timeout(250)
