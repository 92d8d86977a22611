"""The Compare page's first load draws its charts as soon as the histories are read, without departure
marks (the comparison is still being computed), then replaces them with the full grid and the verdicts;
a load whose comparison is cached (memory or disk) or a rerun of a selection already drawn draws once
(Streamlit's AppTest, real SQLite, real disk cache; the grids sent are recorded on their way out)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import streamlit as st

from rldiag.app.dashboard import compare, data
from tests.helpers.browser import READY, chromium, drawn, serve
from tests.helpers.dashboard import app, figures, panels
from tests.helpers.net import stop_group

DRAFT, FULL = "compare.charts.draft", "compare.charts"
WAITING = "Verdicts being computed"
# Set in the page before Streamlit loads: whether the caption of the wait ever showed, and the most charts
# (plotly plots) drawn at once.
WATCH_JS = """new MutationObserver(() => {
    const text = document.body ? document.body.textContent : '';
    window.rldiagWaited = window.rldiagWaited || text.includes('WAITING');
    window.rldiagMostPlots = Math.max(window.rldiagMostPlots || 0, document.querySelectorAll('.js-plotly-plot').length);
}).observe(document, {childList: true, subtree: true, characterData: true});""".replace("WAITING", WAITING)


def _names(spec_panels: dict[str, list[dict]]) -> set[str]:
    return {t["name"] for traces in spec_panels.values() for t in traces}


def _marked(name: str) -> bool:
    return name.startswith("diverges: ") or " band (" in name


def _record(monkeypatch) -> list[tuple[str, dict, int]]:
    """Every grid the page draws, in order: its key, its plotly figure and how many comparisons the
    process had in memory then; the real component still draws each."""
    drawn: list[tuple[str, dict, int]] = []
    real = compare.chart_grid

    def chart_grid(figure: str, *, key: str, config) -> None:
        drawn.append((key, json.loads(figure), len(data._compared()[1])))
        real(figure, key=key, config=config)

    monkeypatch.setattr(compare, "chart_grid", chart_grid)
    return drawn


def test_a_first_load_draws_the_charts_then_the_marks_and_verdicts(dash_store, monkeypatch, tmp_path):
    monkeypatch.setenv("RLDIAG_CACHE_DIR", str(tmp_path / "cache"))  # nothing on disk: a first load
    drawn = _record(monkeypatch)
    at = app(dash_store.uri, monkeypatch, "compare")
    assert [k for k, *_ in drawn] == [DRAFT, FULL]
    assert [n for *_, n in drawn] == [0, 1]  # the early grid before the comparison was made, the full one after
    early, full = (panels(spec) for _, spec, _ in drawn)
    assert list(early) == list(full) and len(full) == 7  # every panel, before the comparison
    assert not any(_marked(n) for n in _names(early))
    assert {"diverges: v1 shifted", "diverges: unmasked"} <= _names(full)
    assert any(" band (" in n for n in _names(full))
    for title, traces in early.items():  # the same lines and NaN markers, only the marks and bands added
        later = {t["name"]: t for t in full[title]}
        for t in traces:
            np.testing.assert_array_equal(t["x"], later[t["name"]]["x"])
            np.testing.assert_array_equal(t["y"], later[t["name"]]["y"])
    # what the page ends with: the full grid alone, the verdicts above it, no word of the wait
    assert len(at.get("bidi_component")) == 1 and _names(panels(drawn[1][1])) == {
        t["name"] for ts in figures(at).values() for t in ts}
    assert [m for m in at.html if "<th>departs</th>" in m.value]
    assert not [c for c in at.caption if WAITING in c.value]

    # a rerun of the session: from memory, drawn once
    drawn.clear()
    at.run()
    assert not at.exception and [k for k, *_ in drawn] == [FULL]
    # another session of the same process (the comparison in its memory): once
    drawn.clear()
    app(dash_store.uri, monkeypatch, "compare")
    assert [k for k, *_ in drawn] == [FULL]
    # a restarted dashboard: nothing in memory, the histories and the comparison on disk: once
    assert data.disk_cache().flush(60)
    st.cache_data.clear()
    st.cache_resource.clear()
    drawn.clear()
    app(dash_store.uri, monkeypatch, "compare")
    assert [k for k, *_ in drawn] == [FULL]


def test_a_session_that_drew_a_selection_recomputes_it_without_an_early_grid(dash_store, monkeypatch, tmp_path):
    """A live refresh (new rows: the comparison computed again) keeps the drawn charts until the new
    ones replace them, instead of swapping in charts without marks every few seconds."""
    monkeypatch.setenv("RLDIAG_CACHE_DIR", str(tmp_path / "cache"))
    drawn = _record(monkeypatch)
    at = app(dash_store.uri, monkeypatch, "compare")
    assert [k for k, *_ in drawn] == [DRAFT, FULL]
    monkeypatch.setenv("RLDIAG_CACHE_DIR", str(tmp_path / "other"))  # nothing cached anywhere now
    st.cache_data.clear()
    st.cache_resource.clear()
    drawn.clear()
    at.run()
    assert not at.exception and [k for k, *_ in drawn] == [FULL]
    assert {"diverges: v1 shifted"} <= _names(panels(drawn[0][1]))


@pytest.mark.browser
def test_in_a_browser_the_full_grid_takes_the_early_ones_place(dash_store, tmp_path, monkeypatch):
    """What Chromium shows: the wait said, then one grid with the marks, the wait's caption gone (a
    container in the early grid's place would have kept both)."""
    monkeypatch.setenv("RLDIAG_CACHE_DIR", str(tmp_path / "cache"))  # the server's first load
    proc, url, _ = serve(dash_store.uri, tmp_path)
    try:
        with chromium() as browser:
            page = browser.new_page(viewport={"width": 1440, "height": 900})
            page.set_default_timeout(180_000)  # a shared 2-core machine can be slow
            page.add_init_script(WATCH_JS)
            page.goto(url + "compare")
            charts = drawn(page, {"policy/ratio_mean": {"v0 ref", "v1 shifted", "diverges: v1 shifted"}})
            page.wait_for_selector(READY)
            assert page.evaluate("() => window.rldiagWaited") is True
            assert page.locator(".rldiag-chart-grid").count() == 1 and page.evaluate("() => window.rldiagMostPlots") == 1
            assert page.get_by_text(WAITING).count() == 0
            assert len(charts) == 7 and page.locator("table", has_text="likely cause").count() == 1
    finally:
        stop_group(proc)
