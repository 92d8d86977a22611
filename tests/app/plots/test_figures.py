"""The overlay figures: right traces, every NaN/inf a marker, references emphasised, names as text."""

from __future__ import annotations

import json

import numpy as np
import plotly.io as pio
import pytest

from rldiag.app.analysis.divergence import detect_divergence
from rldiag.app.data.store import open_store
from rldiag.app.data.trace import Trace
from rldiag.app.plots.figures import (
    DIVERGES_PREFIX,
    REFERENCE_COLOR,
    ChartOptions,
    metric_figure,
    run_colors,
    smooth,
    trace_names,
)


def _trace(run: str, values, steps=None, key: str = "policy/ratio_mean") -> Trace:
    values = np.asarray(values, np.float64)
    steps = np.arange(len(values), dtype=np.int64) if steps is None else np.asarray(steps, np.int64)
    return Trace(run, key, key, steps, values, np.zeros(len(values), np.int64))


def _y(trace) -> np.ndarray:
    return np.asarray(trace.y, np.float64)


def test_reference_is_drawn_last_wider_and_black_candidates_in_their_colours():
    ref, cand = _trace("ref", np.ones(50)), _trace("cand", np.ones(50) * 1.1)
    fig = metric_figure("policy/ratio_mean", {"ref": ref, "cand": cand}, labels={"ref": "v0", "cand": "v1"},
                        reference_ids=["ref"])
    assert trace_names(fig) == ["v1", "v0"]  # candidates first, the reference on top
    v1, v0 = fig.data
    assert v0.line.color == REFERENCE_COLOR and v0.line.width > v1.line.width
    assert v1.line.color == run_colors(["ref", "cand"], ["ref"])["cand"] != REFERENCE_COLOR
    np.testing.assert_allclose(_y(v1), 1.1, rtol=1e-6)


def test_every_nonfinite_point_is_a_marker_and_the_line_keeps_every_spike():
    values = np.random.default_rng(0).normal(0, 1, 100_000)
    values[[10, 20_000, 99_998]] = np.nan
    values[30_000] = np.inf
    values[40_000] = -np.inf
    values[55_555] = 1e4  # a one-step spike among 100k points
    fig = metric_figure("grad/norm", {"r": _trace("r", values, key="grad/norm")}, options=ChartOptions(n_points=1000))
    by_name = {t.name: t for t in fig.data}
    assert set(by_name) == {"r", "r NaN", "r +inf", "r -inf"}
    line = by_name["r"]
    assert len(line.x) <= 1002
    assert 55_555 in set(np.asarray(line.x).tolist()) and _y(line).max() == pytest.approx(1e4)
    assert np.asarray(by_name["r NaN"].x).tolist() == [10, 20_000, 99_998]
    assert np.asarray(by_name["r +inf"].x).tolist() == [30_000]
    assert np.asarray(by_name["r -inf"].x).tolist() == [40_000]
    # markers sit in the strip above the plot (y2), the run's row 0, whatever their kind
    assert by_name["r NaN"].yaxis == "y2" and _y(by_name["r NaN"]).tolist() == [0.0, 0.0, 0.0]
    assert _y(by_name["r -inf"]).tolist() == [0.0] and by_name["r -inf"].yaxis == "y2"


def test_delta_mode_subtracts_the_mean_of_the_references_step_by_step():
    refs = {"a": _trace("a", [1.0, 1.0, 1.0, 1.0]), "b": _trace("b", [3.0, 3.0, 3.0, 3.0])}
    cand = _trace("c", [2.0, 2.5, np.nan, 5.0], steps=[0, 1, 2, 3])
    fig = metric_figure("m", {**refs, "c": cand}, reference_ids=["a", "b"], options=ChartOptions(delta=True))
    by_name = {t.name: t for t in fig.data}
    # reference centre is 2.0 at every step: deltas 0.0, 0.5, (NaN), 3.0; a: -1, b: +1
    np.testing.assert_allclose(_y(by_name["c"]), [0.0, 0.5, 3.0])
    assert np.asarray(by_name["c NaN"].x).tolist() == [2]
    np.testing.assert_allclose(_y(by_name["a"]), -1.0)
    assert "minus reference" in fig.layout.title.text


def test_divergence_onset_is_marked_on_the_candidate():
    rng = np.random.default_rng(1)
    refs = [_trace(f"s{i}", 1 + 0.01 * rng.standard_normal(300)) for i in range(3)]
    shifted = 1 + 0.01 * rng.standard_normal(300)
    shifted[200:] += 0.1  # 10 noise sd from step 200
    cand = _trace("cand", shifted)
    div = detect_divergence(refs, cand)
    assert div.diverged and 195 <= div.onset_step <= 205
    fig = metric_figure("policy/ratio_mean", {**{t.run_id: t for t in refs}, "cand": cand},
                        reference_ids=[t.run_id for t in refs], divergences={"cand": div})
    onset, alert = div.onset_step, div.alert_step
    assert alert > onset  # the trailing medians need a few steps past the onset to see it
    # the diamond on the candidate's curve at the alert, hover text as every product words it
    marker = next(t for t in fig.data if t.name == DIVERGES_PREFIX + "cand")
    assert list(marker.x) == [alert] and marker.y[0] == pytest.approx(shifted[alert], abs=1e-6)
    assert f"alerted at step {alert} (started about step {onset})" in marker.hovertemplate
    assert "level, " in marker.hovertemplate and "(+10%)" in marker.hovertemplate  # its size in metric units
    # a dashed line at the onset, a light span from the onset to the alert
    line, span = fig.layout.shapes
    assert (line.type, line.x0, line.x1, line.line.dash) == ("line", onset, onset, "dash")
    assert (span.type, span.x0, span.x1) == ("rect", onset, alert) and span.fillcolor == marker.marker.color
    # no alert known (an older frame) or the alert at the onset: the diamond at the onset, no span
    import dataclasses

    for same in (dataclasses.replace(div, alert_step=None, departures=()),
                 dataclasses.replace(div, alert_step=onset, departures=())):
        fig = metric_figure("policy/ratio_mean", {"cand": cand}, divergences={"cand": same})
        marker = next(t for t in fig.data if t.name == DIVERGES_PREFIX + "cand")
        assert list(marker.x) == [onset] and [s.type for s in fig.layout.shapes] == ["line"]
        assert f"cand: at step {onset}<br>" in marker.hovertemplate
    # a step range from between the onset and the alert: the span clipped to it, no line
    fig = metric_figure("policy/ratio_mean", {"cand": cand}, divergences={"cand": div},
                        options=ChartOptions(first=onset + 1, last=299))
    assert [(s.type, s.x0, s.x1) for s in fig.layout.shapes] == [("rect", onset + 1, alert)]


def test_the_marker_is_on_the_lead_departure_not_a_burst_that_ended_before_it():
    rng = np.random.default_rng(2)
    refs = [_trace(f"s{i}", 1 + 0.01 * rng.standard_normal(400)) for i in range(3)]
    values = 1 + 0.01 * rng.standard_normal(400)
    values[40:70] += 0.2  # a 20-sd burst that ends ...
    values[250:] += 0.1  # ... before a lasting 10-sd shift
    cand = _trace("cand", values)
    div = detect_divergence(refs, cand)
    assert len(div.departures) >= 2 and div.first.onset_step < 70 and div.lead.onset_step >= 240, div.departures
    fig = metric_figure("policy/ratio_mean", {**{t.run_id: t for t in refs}, "cand": cand},
                        reference_ids=[t.run_id for t in refs], divergences={"cand": div})
    marker = next(t for t in fig.data if t.name == DIVERGES_PREFIX + "cand")
    assert list(marker.x) == [div.lead.alert_step]  # where the headline, the verdict and the band point
    assert f"started about step {div.lead.onset_step})" in marker.hovertemplate


def test_step_range_log_scale_and_smoothing():
    t = _trace("r", np.r_[np.linspace(1, 100, 100), -5.0, 0.0, np.nan])
    fig = metric_figure("m", {"r": t}, options=ChartOptions(first=10, last=102, log_y=True))
    line = next(tr for tr in fig.data if tr.name == "r")
    # -5 (step 100) and 0 (step 101) cannot be drawn on a log axis: every drawn value is > 0, and the
    # line breaks (a null) at step 100, where the block of dropped values starts
    y = _y(line)
    assert min(line.x) == 10 and (y[np.isfinite(y)] > 0).all()
    assert np.asarray(line.x)[np.isnan(y)].tolist() == [100]
    assert fig.layout.yaxis.type == "log"
    assert [tr.name for tr in fig.data] == ["r", "r NaN", "r ≤ 0"]
    # the two dropped points are marked in the strip (the run's row) and counted in the title
    below = next(tr for tr in fig.data if tr.name == "r ≤ 0")
    assert np.asarray(below.x).tolist() == [100, 101] and _y(below).tolist() == [0.0, 0.0]
    assert "2 points ≤ 0 not on the log scale" in fig.layout.title.text
    # TensorBoard's debiased EMA: the first value is kept, then 0.5 * previous + 0.5 * new, debiased
    np.testing.assert_allclose(smooth(np.array([2.0, 4.0, np.nan, 4.0]), 0.5),
                               [2.0, (0.5 * 1.0 + 2.0) / 0.75, np.nan, (0.5 * 2.5 + 2.0) / 0.875])


def test_a_run_keeps_its_colour_whatever_else_is_picked():
    # The experiment's runs oldest first: a (t=1), b (t=2), c (t=3), d (t=4). A candidate's colour is
    # PALETTE[its place in that order]: c is PALETTE[2] with two runs picked and with four.
    import pandas as pd

    from rldiag.app.plots.figures import PALETTE, run_order

    runs = pd.DataFrame({"run_id": ["d", "c", "b", "a"], "start_time": [4, 3, 2, 1]})  # newest first, as find_runs
    order = run_order(runs)
    assert order == ["a", "b", "c", "d"]
    two = run_colors(["a", "c"], ["a"], order=order)
    four = run_colors(["a", "d", "b", "c"], ["a"], order=order)
    assert two["c"] == four["c"] == PALETTE[2] and four["d"] == PALETTE[3] and four["b"] == PALETTE[1]
    assert two["a"] == four["a"] == REFERENCE_COLOR
    # A run outside the order: a stable hash of its id (x's is PALETTE[2]), the same in any list where
    # no run before it has that colour; beside c (PALETTE[2]) it takes the next free one, so the two differ
    assert run_colors(["x", "d"], order=order)["x"] == run_colors(["b", "x"], order=order)["x"] == PALETTE[2]
    assert run_colors(["x", "c"], order=order) == {"x": PALETTE[3], "c": PALETTE[2]}


def test_two_runs_nan_at_the_same_steps_both_show_under_their_runs_legend_entry():
    a = _trace("a", [1.0, np.nan, np.nan, 1.0], key="grad/norm")
    b = _trace("b", [1.0, np.nan, np.nan, np.inf], key="grad/norm")
    fig = metric_figure("grad/norm", {"a": a, "b": b})
    by_name = {t.name: t for t in fig.data}
    # a's NaN markers in the strip's first row (0), b's in the next (1), each in its colour
    assert _y(by_name["a NaN"]).tolist() == [0.0, 0.0] and _y(by_name["b NaN"]).tolist() == [1.0, 1.0]
    assert _y(by_name["b +inf"]).tolist() == [1.0]
    assert by_name["a NaN"].marker.color == by_name["a"].line.color != by_name["b NaN"].marker.color
    assert by_name["b NaN"].marker.color == by_name["b"].line.color
    # markers go with their run's legend entry (a click hides both) and have none of their own: the legend
    # lists the runs, and its title is the one key to the marker kinds drawn
    assert all(by_name[n].showlegend is False and by_name[n].legendgroup == n[0] for n in ("a NaN", "b NaN", "b +inf"))
    assert [t.name for t in fig.data if t.showlegend is not False] == ["a", "b"]
    assert fig.layout.legend.title.text.strip() == "× NaN  ▲ +inf"
    # no marker drawn: no key
    assert not metric_figure("grad/norm", {"a": _trace("a", [1.0, 2.0])}).layout.legend.title.text


def test_onsets_at_one_step_split_the_line_and_nest_their_diamonds():
    from rldiag.app.analysis.divergence import Divergence

    ref = _trace("ref", np.ones(30))
    cands = {c: _trace(c, np.r_[np.ones(10), np.full(20, 2.0)]) for c in ("c1", "c2")}
    div = {c: Divergence("m", 10, "level", None, 1.0, 10.0, None, 30) for c in cands}
    fig = metric_figure("m", {"ref": ref, **cands}, reference_ids=["ref"], divergences=div)
    # two candidates leaving at step 10: two dashed segments, one on top of the other (0-0.5, 0.5-1)
    assert sorted((s.x0, s.y0, s.y1) for s in fig.layout.shapes) == [(10, 0.0, 0.5), (10, 0.5, 1.0)]
    assert {s.line.color for s in fig.layout.shapes} == {fig.data[0].line.color, fig.data[1].line.color}
    # the diamonds under their runs' entries; the key names them once
    assert [t.name for t in fig.data if t.showlegend is not False] == ["c1", "c2", "ref"]
    assert fig.layout.legend.title.text.strip() == "◆ alert  ╎ onset"
    # their diamonds at one point nest, the first drawn the larger, so the second's colour shows inside it
    assert [t.marker.size for t in fig.data if t.name.startswith(DIVERGES_PREFIX)] == [17, 11]


def test_a_run_with_only_nan_values_keeps_its_line_entry():
    fig = metric_figure("grad/norm", {"r": _trace("r", [np.nan, np.nan], key="grad/norm")})
    line = next(t for t in fig.data if t.name == "r")
    assert line.showlegend is not False and len(line.x) == 1 and np.isnan(_y(line)).all()


def test_bad_options_say_what_to_use():
    with pytest.raises(ValueError, match=r"smoothing=1.0: use a weight in \[0, 1\)"):
        ChartOptions(smoothing=1.0)
    with pytest.raises(ValueError, match="step range 50..10 is empty"):
        ChartOptions(first=50, last=10)


def test_html_shaped_run_names_stay_text_in_the_figure_json():
    evil = "<img src=x onerror=alert(1)> %{y}"
    fig = metric_figure("m", {"r": _trace("r", [1.0, np.nan])}, labels={"r": evil})
    spec = json.loads(pio.to_json(fig))
    raw = json.dumps(spec)
    assert "<img" not in raw and "%{y}<" not in raw  # escaped for plotly's HTML subset and templates
    assert trace_names(fig) == [evil, evil + " NaN"]  # and read back as the same text


@pytest.mark.slow
def test_a_run_of_a_million_points_loads_and_draws_bounded(tmp_path):
    # 1 M points of one metric, stored as MLflow stores them (bench's store builder), NaN/inf included
    from rldiag.app.data.histories import load_histories
    from tests.helpers.bench_code import metric_store

    n = 1_000_000

    def series(run_no, key_no, key):
        v = np.random.default_rng(0).normal(0, 1, n)
        v[[7, 500_000]] = np.nan
        v[999_999] = np.inf
        v[123_456] = 1e3  # one spike
        return v

    uri, (rid,) = metric_store(tmp_path / "big.db", "big", [("big", {}, {})], ["grad/norm"], n, series)
    t = load_histories(open_store(uri), [rid], ["grad/norm"]).get(rid, "grad/norm")
    assert len(t) == n
    fig = metric_figure("grad/norm", {rid: t}, labels={rid: "big"})
    by_name = {tr.name: tr for tr in fig.data}
    assert len(by_name["big"].x) <= 2002 and 123_456 in set(np.asarray(by_name["big"].x).tolist())
    assert np.asarray(by_name["big NaN"].x).tolist() == [7, 500_000]
    assert np.asarray(by_name["big +inf"].x).tolist() == [999_999]
    assert len(pio.to_json(fig)) < 200_000  # what the browser gets stays small


@pytest.mark.parametrize("options", [ChartOptions(), ChartOptions(delta=True, smoothing=0.5, log_y=True, first=5, last=250)])
def test_figure_is_what_plotly_validates(options):
    """metric_figure skips plotly's per-property validation for speed: its JSON must be exactly what
    plotly's validated figure of the same content gives (no shorthand plotly.js would misread)."""
    import plotly.graph_objects as go

    rng = np.random.default_rng(3)
    refs = {f"s{i}": _trace(f"s{i}", 1 + 0.01 * rng.standard_normal(300)) for i in range(3)}
    values = 1 + 0.01 * rng.standard_normal(300)
    values[150:] += 0.2
    values[[7, 200]] = [np.nan, np.inf]
    values[201] = -np.inf
    cand = _trace("c", values)
    divs = {"c": detect_divergence(list(refs.values()), cand)}
    assert divs["c"].diverged
    fig = metric_figure("policy/ratio_mean", {**refs, "c": cand}, reference_ids=list(refs), divergences=divs,
                        labels={"c": "<b>v1</b> %{y}"}, options=options)
    ours = json.loads(fig.to_json())
    validated = json.loads(go.Figure(fig.to_dict()).to_json())
    assert ours == validated
    assert ours["layout"]["template"]["layout"]["plot_bgcolor"] == "white"  # plotly_white, expanded for plotly.js
    assert ours["layout"]["shapes"][0]["x0"] == divs["c"].lead.onset_step


def test_ten_runs_nan_markers_sit_in_a_strip_of_their_own_above_the_data():
    """Issue 44: staggered NaN markers inside the axis squeezed grad/norm's 0-12 into its bottom third."""
    rng = np.random.default_rng(4)
    runs = {}
    for i in range(10):
        v = 12 * rng.random(200)
        if i >= 3:
            v[[0, 50, 120]] = np.nan
            v[150] = np.inf if i % 2 else -np.inf
        runs[f"r{i}"] = _trace(f"r{i}", v, key="grad/norm")
    fig = metric_figure("grad/norm", runs, reference_ids=["r0", "r1", "r2"])
    lay = fig.layout
    data_lo, data_hi = lay.yaxis.domain
    strip_lo, strip_hi = lay.yaxis2.domain
    # the strip is its own band above the data axis, not an axis laid over it
    assert data_lo == 0.0 and data_hi < strip_lo < strip_hi == 1.0 and lay.yaxis2.overlaying is None
    assert strip_hi - strip_lo <= 0.4 and lay.yaxis2.ticktext == ("NaN/inf",)
    markers = [t for t in fig.data if t.mode == "markers" and not t.name.startswith(DIVERGES_PREFIX)]
    lines = [t for t in fig.data if t.mode == "lines"]
    assert len(markers) == 7 * 2 and all(t.yaxis == "y2" for t in markers)
    assert all(t.yaxis in (None, "y") for t in lines)  # the data axis autoscales over the lines alone
    # one row per run with markers, in the strip's range (first run on top), none at a data value
    rows = sorted({float(_y(t)[0]) for t in markers})
    assert rows == [float(i) for i in range(7)] and lay.yaxis2.range == (6.5, -0.5)
    for t in markers:
        assert len(set(_y(t).tolist())) == 1
    # a light band behind the strip
    assert [s.yref for s in lay.shapes if s.type == "rect"] == ["y2 domain"]


def test_no_nonfinite_point_no_strip_and_the_legend_above_the_plot():
    fig = metric_figure("loss", {f"r{i}": _trace(f"r{i}", np.ones(20)) for i in range(10)}, reference_ids=["r0"],
                        labels={f"r{i}": f"run {i} with a longer name" for i in range(10)})
    lay = fig.layout
    assert lay.yaxis.domain == (0.0, 1.0) and lay.yaxis2.overlaying == "y" and lay.yaxis2.visible is False
    # the legend: horizontal above the plot, its rows counted into the top margin and the height
    assert (lay.legend.orientation, lay.legend.yanchor, lay.legend.y) == ("h", "bottom", 1)
    one = metric_figure("loss", {"r0": _trace("r0", np.ones(20))})
    assert lay.margin.t > one.layout.margin.t and lay.height - one.layout.height == lay.margin.t - one.layout.margin.t
