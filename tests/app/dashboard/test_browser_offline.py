"""Every page of `rldiag app`, drawn by a real Chromium, asks nothing of another machine (no font host
for the tab's icon, no CDN), opens at its own path (/runs too, the page a bare URL opens), and shows no
Streamlit "Deploy" button: the dashboard is a local, read-only tool."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest

from tests.helpers.browser import READY, chromium, serve
from tests.helpers.net import stop_group

PAGES = ("", "runs", "compare", "nan-events", "config-diff")
LOCAL = {"127.0.0.1", "localhost", "::1"}


@pytest.mark.browser
def test_no_page_requests_another_machine_and_every_path_opens(dash_store, tmp_path):
    proc, url, _ = serve(dash_store.uri, tmp_path)
    requests: list[str] = []
    try:
        with chromium() as browser:
            page = browser.new_page(viewport={"width": 1440, "height": 900})
            page.set_default_timeout(180_000)  # a shared 2-core machine can be slow
            page.on("request", lambda r: requests.append(r.url))
            opened = {}
            for path in PAGES:
                page.goto(url + path)
                page.wait_for_selector(READY)
                page.get_by_test_id("stSidebar").wait_for()
                page.wait_for_timeout(1500)  # charts and icons load after the script run
                opened[path] = (page.get_by_text("Page not found").count(),
                                page.locator('[data-testid="stAppDeployButton"]').count())
    finally:
        stop_group(proc)
    assert opened == {p: (0, 0) for p in PAGES}, opened  # (page-not-found notices, deploy buttons) per path
    assert len(requests) > 10  # the pages did load (scripts, styles, the websocket)
    # data: and blob: URLs are the page's own; every http(s)/ws request goes to the dashboard's server
    remote = [r for r in requests if urlsplit(r).scheme in ("http", "https", "ws", "wss")
              and urlsplit(r).hostname not in LOCAL]
    assert remote == [], remote[:5]
