"""app/dashboard/grid_figure.py: one-metric figures as the panels of one figure, two a row, each panel
keeping its traces, markers, onset lines and title; one legend; margins that never grow."""

from __future__ import annotations

import copy
import html

import numpy as np
import pytest

from rldiag.app.analysis.divergence import Divergence
from rldiag.app.data.trace import Trace
from rldiag.app.plots.figures import metric_figure
from rldiag.app.plots.grid_figure import LEGEND_WIDTH_PX, grid_figure
from tests.helpers.dashboard import panels

EVIL = "<img src=x onerror=alert(1)>"


def _trace(run: str, key: str, values) -> Trace:
    values = np.asarray(values, np.float64)
    return Trace(run, key, key, np.arange(len(values), dtype=np.int64), values, np.zeros(len(values), np.int64))


def _figures() -> list[dict]:
    """ratio (ref, cand: diverges at step 5), grad/norm (ref, cand with a NaN at 3, EVIL), loss (cand only)."""
    grad = np.ones(10)
    grad[3] = np.nan
    onset = Divergence("policy/ratio_mean", 5, "level", None, 0.5, 6.0, None, steps_compared=10)
    ratio = {"ref": _trace("ref", "r", np.ones(10)), "cand": _trace("cand", "r", np.r_[np.ones(5), 2 * np.ones(5)])}
    return [
        metric_figure("policy/ratio_mean", ratio, reference_ids=["ref"], divergences={"cand": onset}).to_plotly_json(),
        metric_figure("grad/norm", {"ref": _trace("ref", "g", np.ones(10)), "cand": _trace("cand", "g", grad),
                                    "evil": _trace("evil", "g", np.ones(10))},
                      labels={"evil": EVIL}, reference_ids=["ref"]).to_plotly_json(),
        metric_figure("loss", {"cand": _trace("cand", "l", np.ones(10))}).to_plotly_json(),
    ]


def test_panels_two_a_row_keep_their_traces_markers_onset_lines_and_titles():
    figures = _figures()
    before = copy.deepcopy(figures)
    fig = grid_figure(figures)
    assert figures == before  # the inputs (cached figures) are not modified
    lay = fig["layout"]
    # 3 panels: x/y, x2/y2 on the first row, x3/y3 below on the left; markers on y4..y6 over them
    assert lay["xaxis"]["domain"][1] < lay["xaxis2"]["domain"][0] and lay["xaxis3"]["domain"] == lay["xaxis"]["domain"]
    assert lay["yaxis"]["domain"][0] == lay["yaxis2"]["domain"][0]
    assert lay["yaxis3"]["domain"][1] < lay["yaxis"]["domain"][0]
    # grad/norm (NaN at step 3): its strip y5 a band at the top of the panel, above its data axis y2;
    # ratio (no NaN): a hidden axis y4 over its data axis, which takes the panel's whole height
    assert "overlaying" not in lay["yaxis5"] and lay["yaxis5"]["domain"][1] == pytest.approx(lay["yaxis"]["domain"][1])
    assert lay["yaxis2"]["domain"][0] == pytest.approx(lay["yaxis"]["domain"][0])
    assert lay["yaxis2"]["domain"][1] < lay["yaxis5"]["domain"][0]
    assert lay["yaxis4"]["overlaying"] == "y" and not lay["yaxis4"]["visible"]
    assert lay["yaxis4"]["domain"] == lay["yaxis"]["domain"]
    # each panel's title sits over its top band: the strip where there is one
    titles = {a["text"]: a["yref"] for a in lay["annotations"]}
    assert titles == {"policy/ratio_mean": "y domain", "grad/norm": "y5 domain", "loss": "y3 domain"}
    # a reader finds each panel's traces by the title over its x axis: the same traces as the figure alone
    by_panel = panels(fig)
    assert list(by_panel) == ["policy/ratio_mean", "grad/norm", "loss"]
    for figure, traces in zip(figures, by_panel.values()):
        assert [t["name"] for t in traces] == [t["name"] for t in figure["data"]]
    grad = {t["name"]: t for t in by_panel["grad/norm"]}
    assert grad["cand NaN"]["yaxis"] == "y5" and grad["cand NaN"]["x"].tolist() == [3]  # on its panel's marker axis
    assert grad["cand"]["yaxis"] == "y2" and html.escape(EVIL, quote=False) in grad  # names stay escaped text
    # the onset: a dashed line over the whole height of its own panel, and the diamond
    [line] = [s for s in lay["shapes"] if s["type"] == "line"]
    [band] = [s for s in lay["shapes"] if s["type"] == "rect"]  # behind grad/norm's strip
    assert (band["xref"], band["yref"]) == ("x2 domain", "y5 domain")
    assert (line["xref"], line["yref"], line["x0"]) == ("x", "y domain", 5)
    assert {t["name"]: t for t in by_panel["policy/ratio_mean"]}["diverges: cand"]["x"].tolist() == [5]


def test_one_legend_lists_each_run_once_and_margins_never_grow():
    fig = grid_figure(_figures())
    listed = [t["name"] for t in fig["data"] if t["showlegend"]]
    # each run's line once, from the first panel that draws it; no entry for a marker (the onset diamond,
    # the NaN x): one key, the legend's title, names the kinds of every panel (ratio's diamond, grad's NaN)
    assert listed == ["cand", "ref", html.escape(EVIL, quote=False)]
    assert fig["layout"]["legend"]["title"]["text"].strip() == "× NaN  ◆ alert  ╎ onset"
    assert "title" not in grid_figure(_figures()[2:])["layout"]["legend"]  # loss: no marker, no key
    # every trace of a run shares its legendgroup: a click on a run hides it in every panel
    groups = {t["legendgroup"] for t in fig["data"] if t["name"].startswith("cand") or t["name"].endswith(" cand")}
    assert groups == {"cand"}
    margin = fig["layout"]["margin"]
    assert margin["autoexpand"] is False and fig["layout"]["legend"]["yanchor"] == "bottom"  # above the panels
    many = [metric_figure("loss", {f"run {i:02d} with a long name": _trace(f"r{i}", "l", np.ones(3))
                                   for i in range(40)}).to_plotly_json()]
    # 40 entries of ~150 px cannot fit one 800 px row: the top margin holds the rows they need
    assert grid_figure(many)["layout"]["margin"]["t"] >= 40 * 150 // LEGEND_WIDTH_PX * 20 > margin["t"]


def test_bad_layouts_are_refused():
    with pytest.raises(ValueError, match="at least one figure"):
        grid_figure([])
    with pytest.raises(ValueError, match="columns=0"):
        grid_figure(_figures(), columns=0)
