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


def screenshot(page, name: str) -> Path:
    """Save a full-page PNG under tests/artifacts/ and return its path."""
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path
