"""Charts at 10 runs as a reader sees them in Chromium (issue 44): the NaN/inf markers in their strip
above the data, the data's axis over the data alone, the legend above the plot with one entry per run
and one key to the markers, ten distinct colours."""

from __future__ import annotations

import numpy as np
import pytest

from rldiag.app.analysis.divergence import Divergence
from rldiag.app.data.trace import Trace
from rldiag.app.plots.figures import metric_figure
from rldiag.app.plots.grid_figure import grid_figure
from tests.helpers.browser import chromium, screenshot

REFS = ("ref 0", "ref 1", "ref 2")
# Per drawn chart: the data axis' range and box, the strip's box, each marker trace's page y, the legend's box.
LAYOUT_JS = """() => [...document.querySelectorAll('.js-plotly-plot')].map(p => {
    const L = p._fullLayout, box = a => [a._offset, a._offset + a._length];
    const strips = Object.keys(L).filter(k => /^yaxis\\d*$/.test(k) && L[k].visible !== false && !L[k].overlaying
                                         && (L[k].ticktext || []).length);
    const markers = p._fullData.filter(t => / (NaN|\\+inf|-inf)$/.test(t.name)).map(t => {
        const ya = L[t.yaxis.replace('y', 'yaxis')]; return [t.name, t.yaxis, ya._offset + ya.l2p(t.y[0])]; });
    const lg = p.querySelector('.legend').getBoundingClientRect();
    return {range: L.yaxis.range, data: box(L.yaxis), strips: strips.map(k => [k, box(L[k])]), markers,
            legend: [lg.left, lg.top, lg.right, lg.bottom], width: L.width, top: L.margin.t,
            entries: [...p.querySelectorAll('.legend .legendtext')].map(t => t.textContent),
            key: [...p.querySelectorAll('.legend .legendtitletext')].map(t => t.textContent),
            colors: [...new Set(p._fullData.filter(t => t.mode === 'lines').map(t => t.line.color))]};
})"""


def _runs() -> dict[str, Trace]:
    """grad/norm of 10 runs between 0 and 12; 7 candidates NaN at steps 0, 50, 120, +inf or -inf at 150."""
    rng = np.random.default_rng(0)
    out = {}
    for i, run in enumerate([*REFS, *(f"candidate {i}" for i in range(7))]):
        v = 12 * rng.random(200)
        if i >= 3:
            v[[0, 50, 120]] = np.nan
            v[150] = np.inf if i % 2 else -np.inf
        out[run] = Trace(run, "grad/norm", "grad/norm", np.arange(200), v, np.zeros(200, np.int64))
    return out


@pytest.mark.browser
def test_ten_runs_markers_above_the_data_in_chromium(tmp_path):
    import plotly.io as pio
    from plotly.offline import get_plotlyjs

    runs = _runs()
    finite = {r: Trace(r, "loss", "loss", t.steps, np.nan_to_num(t.values, posinf=12, neginf=0), t.steps * 0)
              for r, t in runs.items()}
    divs = {r: Divergence("grad/norm", 0, "level", None, 1.0, 10.0, None, 200) for r in list(runs)[3:]}
    fig = metric_figure("grad/norm", runs, reference_ids=REFS, divergences=divs)
    grid = grid_figure([fig.to_plotly_json(), metric_figure("loss", finite, reference_ids=REFS).to_plotly_json()])
    page_html = (f"<html><head><meta charset='utf-8'><script>{get_plotlyjs()}</script></head>"
                 f"<body style='margin:0'><div id='one' style='width:620px'></div><div id='grid'></div><script>"
                 f"const a = {pio.to_json(fig)}, b = {pio.to_json(grid)};"
                 "Plotly.newPlot('one', a.data, a.layout); Plotly.newPlot('grid', b.data, b.layout);"
                 "</script></body></html>")
    path = tmp_path / "ten_runs.html"
    path.write_text(page_html, encoding="utf-8")
    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(path.as_uri())
        page.wait_for_function("() => [...document.querySelectorAll('.js-plotly-plot')].every(p => p._fullLayout)",
                               timeout=120_000)
        one, panels = page.evaluate(LAYOUT_JS)
        screenshot(page, "figures-ten-runs")
    # the data axis autoscales to the data (0-12, plotly's 5% pad), not to the markers
    assert -1 < one["range"][0] < 0.5 and 11.5 < one["range"][1] < 13, one["range"]
    [(strip_axis, (strip_top, strip_bottom))] = one["strips"]
    data_top = one["data"][0]
    assert strip_axis == "yaxis2" and strip_bottom < data_top  # page y grows downwards: the strip is above
    ys = sorted(y for _, _, y in one["markers"])
    assert len(one["markers"]) == 7 * 2 and all(strip_top - 6 <= y <= strip_bottom + 6 for y in ys)
    rows = sorted({round(y) for name, _, y in one["markers"] if name.endswith(" NaN")})
    assert len(rows) == 7 and min(np.diff(rows)) >= 5  # one row per run, apart
    # the legend above the plot, as wide as the chart at most (it took 40% of its width at the right)
    assert one["legend"][3] <= strip_top and one["legend"][2] <= 620
    assert len(one["colors"]) == 10  # ten runs, ten colours
    # one legend entry per run (it had 24 with an entry per marker kind and run), and one key to the
    # markers drawn; in the Compare grid the same, its key naming every panel's kinds
    for chart in (one, panels):
        assert sorted(chart["entries"]) == sorted(runs), chart["entries"]
        assert [k.split() for k in chart["key"]] == [["×", "NaN", "▲", "+inf", "▼", "-inf", "◆", "alert", "╎", "onset"]]
        assert chart["legend"][3] - chart["legend"][1] <= chart["top"]  # the top margin holds all its rows
    # the Compare grid: grad/norm's strip over its data, loss (no NaN) without one
    assert [k for k, _ in panels["strips"]] == ["yaxis3"] and panels["strips"][0][1][1] < panels["data"][0]
