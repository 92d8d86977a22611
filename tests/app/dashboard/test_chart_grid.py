"""app/dashboard/chart_grid.py: when the chart grid component can be had, and when each figure falls
back to `st.plotly_chart` (what the page then shows is in test_pages.py; drawn, in test_browser.py)."""

from __future__ import annotations

import sys

from rldiag.app.dashboard import chart_grid


def test_the_component_carries_the_basic_plotly_bundle_and_the_grid_code():
    assert chart_grid._MOUNT is not None  # this environment's Streamlit has st.components.v2
    head = chart_grid.BUNDLE.read_text(encoding="utf-8")[:200]
    assert "plotly.js (basic - minified)" in head and "MIT license" in head  # the licence header travels with it


def test_older_streamlit_or_a_missing_bundle_means_plotly_chart(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "streamlit.components.v2", None)  # as before Streamlit 1.51: ImportError
    assert chart_grid._register() is None
    monkeypatch.undo()
    monkeypatch.setattr(chart_grid, "BUNDLE", tmp_path / "plotly-basic.min.js")  # e.g. a wheel without static/
    assert chart_grid._register() is None
