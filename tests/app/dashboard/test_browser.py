"""The dashboard served by `rldiag app` and drawn by a real Chromium: runs picked in the sidebar,
charts drawn with the right traces and NaN markers, a run named like HTML shown as text."""

from __future__ import annotations

import html

import pytest

from tests.helpers.browser import READY, chromium, drawn, screenshot, serve
from tests.helpers.dash_store import EVIL, NAN_STEPS
from tests.helpers.net import stop_group

# The chart grid's legend: its height and the top margin that holds it (no row may be cut off above).
LEGEND_JS = """() => { const gd = document.querySelector('.rldiag-chart-grid');
    return [gd.querySelector('.legend').getBBox().height, gd._fullLayout.margin.t]; }"""
# The width plotly laid out each drawn chart at.
WIDTHS_JS = """() => [...document.querySelectorAll('.js-plotly-plot')].filter(p => p._fullLayout)
    .map(p => p._fullLayout.width)"""


@pytest.mark.browser
def test_picked_runs_are_drawn_with_nan_markers_and_names_as_text(dash_store, tmp_path):
    proc, url, log = serve(dash_store.uri, tmp_path)
    dialogs: list[str] = []
    try:
        with chromium() as browser:
            page = browser.new_page(viewport={"width": 1500, "height": 1100})
            page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
            page.set_default_timeout(180_000)  # a shared 2-core machine can be slow
            page.goto(url + "compare")
            sidebar = page.get_by_test_id("stSidebar")
            group = sidebar.get_by_role("combobox", name="Comparison group (rldiag.group)")
            group.wait_for()  # the first script run is done: the sidebar holds the run pickers
            assert group.input_value() == "v0_vs_v1"  # the newest run's group, from the tags
            # In the sidebar: every run of the experiment, then add the TRL run to the candidates.
            group.click()
            page.get_by_role("option", name="(all runs)").click()
            candidates = sidebar.get_by_role("combobox", name="Candidate run(s)")
            page.wait_for_function("() => ![...document.querySelectorAll('[role=combobox]')]"
                                   ".some(e => e.value === 'v0_vs_v1')")
            page.wait_for_selector(READY)
            candidates.click()
            page.keyboard.type("trl")
            page.get_by_role("option", name="trl run").click()
            page.keyboard.press("Escape")
            charts = drawn(page, {
                "policy/ratio_mean": {"v0 ref", "v1 shifted", "diverges: v1 shifted", html.escape(EVIL, quote=False)},
                "grad/norm": {"v0 ref", "unmasked", "unmasked NaN", "unmasked +inf", "trl run"},
                "policy/kl_new_old": {"diverges: v1 shifted"},  # TRL's kl is KL to the reference: not here
            })
            assert charts["grad/norm"]["unmasked NaN"] == list(NAN_STEPS)
            # only v1 shifted leaves the band, and unmasked's NaN grad norm (a nonfinite departure) on grad/norm
            assert not [(t, n) for t, c in charts.items() for n in c if n.startswith("diverges: ")
                        and "v1 shifted" not in n and (n, t) != ("diverges: unmasked", "grad/norm")]
            # The run named like an <img> tag is text wherever it shows: sidebar chip, caption, legend
            # (plotly keeps names as escaped markup and draws them as text).
            assert page.get_by_text(EVIL, exact=True).count() >= 2
            assert page.locator("svg.main-svg text.legendtext", has_text=EVIL).count() >= 1
            assert page.locator('img[src="x"]').count() == 0 and dialogs == []
            # One figure of panels, two a row, as wide as the main column; it follows the column when the
            # window narrows. One legend: each run listed once.
            [width] = page.evaluate(WIDTHS_JS)
            assert 900 < width < 1200  # a 1,500 px window less the sidebar
            legend = page.locator("svg.main-svg text.legendtext").all_text_contents()
            # each run once, markers (the onset diamond, NaN x, inf triangles) under their run, no entries of
            # their own: one key, the legend's title, names the kinds
            assert legend.count("v1 shifted") == 1 and len(legend) == len(set(legend)), legend
            assert not [n for n in legend if n.startswith("diverges: ") or n.endswith((" NaN", " +inf", " -inf"))]
            [key] = page.locator("svg.main-svg text.legendtitletext").all_text_contents()
            assert key.split() == ["×", "NaN", "▲", "+inf", "◆", "alert", "╎", "onset", "▒", "band", "tested,", "┈",
                                   "its", "trailing", "median"], key  # v1 shifted's tested band is drawn
            legend_h, top = page.evaluate(LEGEND_JS)
            assert 20 < legend_h <= top  # one row at this width: the margin grid_figure estimated holds it
            page.set_viewport_size({"width": 1100, "height": 1100})
            page.wait_for_function(f"() => ({WIDTHS_JS})()[0] < {width - 200}")
            # narrower: the legend wraps to a second row; the margin grows with it (chart_grid.js)
            page.wait_for_function(f"() => {{ const [h, t] = ({LEGEND_JS})(); return h > {legend_h} && h <= t; }}",
                                   timeout=20_000)
            page.wait_for_timeout(500)
            shot = screenshot(page, "dashboard-compare")
            assert shot.stat().st_size > 50_000
    finally:
        stop_group(proc)
    assert "rldiag dashboard: " + url in log.read_text()
