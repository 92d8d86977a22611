"""The Compare page's chart detail (compare.CHART_POINTS line points per run) and what reaches the browser
(chart_grid.payload): at 100k steps a one-step spike and dip, every NaN and a lasting shift still show."""

from __future__ import annotations

import json

import numpy as np
import plotly.io

from rldiag.app.dashboard import chart_grid, compare
from rldiag.app.data.trace import Trace
from rldiag.app.plots.figures import ChartOptions, metric_figure
from rldiag.app.plots.grid_figure import grid_figure
from tests.helpers.dashboard import array as _array

STEPS = 100_000


def _trace(run: str, values: np.ndarray) -> Trace:
    return Trace(run, "grad/norm", "grad/norm", np.arange(len(values), dtype=np.int64), values,
                 np.zeros(len(values), np.int64))


def _page_figure() -> dict:
    """A reference and a candidate as the page draws them (its CHART_POINTS), through the component's payload."""
    rng = np.random.default_rng(7)
    ref = np.cumsum(rng.normal(0, 0.01, STEPS)) + 1.0
    cand = np.cumsum(rng.normal(0, 0.01, STEPS)) + 1.0
    cand[60_000:] += 5.0  # a lasting shift from step 60k
    cand[12_345] += 30.0  # a one-step spike
    cand[77_777] -= 30.0  # a one-step dip
    cand[[500, 50_001, 99_998]] = np.nan
    fig = metric_figure("grad/norm", {"ref": _trace("ref", ref), "cand": _trace("cand", cand)},
                        reference_ids=["ref"], options=ChartOptions(n_points=compare.CHART_POINTS))
    figure = plotly.io.to_json(grid_figure([fig.to_plotly_json()]), validate=False)
    sent = json.loads(chart_grid.payload(figure, compare.PLOT_CONFIG))
    assert sent["config"] == compare.PLOT_CONFIG
    return sent["figure"]


def test_a_spike_a_dip_every_nan_and_a_lasting_shift_reach_the_browser_at_the_pages_detail():
    traces = {t["name"]: t for t in _page_figure()["data"]}
    line = traces["cand"]
    x, y = _array(line["x"]).astype(np.int64), _array(line["y"]).astype(np.float64)
    assert len(x) <= compare.CHART_POINTS + 2  # decimated: each bucket's min and max, and both ends
    drawn = dict(zip(x.tolist(), y.tolist()))
    assert drawn[12_345] > 20 and drawn[77_777] < -20  # the spike and the dip, each one step of 100k
    assert sorted(_array(traces["cand NaN"]["x"]).astype(np.int64).tolist()) == [500, 50_001, 99_998]
    before, after = y[(x < 60_000) & (np.abs(y) < 20)], y[(x >= 60_000) & (np.abs(y) < 20)]
    assert np.median(after) - np.median(before) > 3  # the shift of 5 reads as one
    assert len(after) > 0.3 * len(x)  # and the line after it is drawn in full detail, not a few points


def test_the_payload_is_the_figure_as_it_was_built():
    figure = plotly.io.to_json({"data": [{"type": "scatter", "x": [1, 2], "y": [3, "é"]}], "layout": {}})
    sent = json.loads(chart_grid.payload(figure, {"displaylogo": False}))
    assert sent == {"config": {"displaylogo": False}, "figure": json.loads(figure)}
