"""The band a chart draws is the band the detector tests (issue 41): `compute_band`'s default band is the
longest trailing window's bar, and the candidate's trailing median leaves it where the detector alerts."""

from __future__ import annotations

import numpy as np
import pytest

from rldiag.app.analysis.divergence import DivergenceConfig, compute_band, detect_divergence
from rldiag.app.data.trace import Trace

N, SD = 400, 0.05


def _ar(rng, phi: float = 0.6) -> np.ndarray:
    e, x = rng.standard_normal(N), np.zeros(N)
    for i in range(1, N):
        x[i] = phi * x[i - 1] + np.sqrt(1 - phi**2) * e[i]
    return x


def _trace(run: str, values: np.ndarray) -> Trace:
    return Trace(run, "m", "m", np.arange(len(values)), values, np.zeros(len(values), np.int64))


def _runs(shift_sd: float, seed: int = 3) -> tuple[list[Trace], Trace]:
    """Three AR(0.6) reference seeds around 1 and a candidate shifted by `shift_sd` noise sd from step 150."""
    rng = np.random.default_rng(seed)
    refs = [_trace(f"r{i}", 1 + SD * _ar(rng)) for i in range(3)]
    v = 1 + SD * _ar(rng)
    v[150:] += shift_sd * SD
    return refs, _trace("c", v)


def _first_outside(band) -> int | None:
    out = (band.candidate < band.lower) | (band.candidate > band.upper)
    return int(band.steps[np.flatnonzero(out)[0]]) if out.any() else None


def test_a_lasting_shift_leaves_the_drawn_band_where_the_detector_alerts():
    refs, cand = _runs(1.5)
    d = detect_divergence(refs, cand)
    assert d.diverged and d.kind == "level" and d.end_step is None
    band, _, _ = compute_band(refs, cand)
    assert band.window == DivergenceConfig().windows[-1]  # the longest window: the narrowest bar
    assert _first_outside(band) == d.alert_step
    width_sd = np.median(band.upper - band.lower) / SD
    assert 2 < width_sd < 5, width_sd
    # the shortest window's band (what charts were given before) is 2-3 times as wide and holds the
    # candidate's median throughout: drawn, it said "inside" of a candidate the detector flagged
    short, _, _ = compute_band(refs, cand, window=DivergenceConfig().windows[0])
    assert np.median(short.upper - short.lower) / SD > 2 * width_sd and _first_outside(short) is None


def test_a_candidate_without_a_departure_stays_inside_and_a_floor_widens_the_band():
    refs, cand = _runs(0.0, seed=5)
    assert not detect_divergence(refs, cand).diverged
    band, _, _ = compute_band(refs, cand)
    assert _first_outside(band) is None
    floored, _, _ = compute_band(refs, cand, DivergenceConfig(min_delta=0.02))
    assert np.allclose(floored.upper - band.upper, 0.02) and np.allclose(band.lower - floored.lower, 0.02)


def test_a_window_the_detector_does_not_test_is_refused():
    refs, cand = _runs(0.0)
    with pytest.raises(ValueError, match=r"window=7: use one of the detector's windows \(11, 21"):
        compute_band(refs, cand, window=7)


def test_a_chart_given_the_band_draws_it_beneath_the_runs_with_the_median_it_tests():
    from rldiag.app.plots.figures import ChartOptions, metric_figure

    refs, cand = _runs(1.5)
    d = detect_divergence(refs, cand)
    band, _, _ = compute_band(refs, cand)
    runs = {**{t.run_id: t for t in refs}, "c": cand}
    fig = metric_figure("m", runs, reference_ids=[t.run_id for t in refs], divergences={"c": d}, bands={"c": band})
    shape, median = fig.data[:2]  # beneath every run's line: one filled shape, its upper edge and back its lower
    assert shape.fill == "toself" and shape.fillcolor.startswith("rgba(") and shape.line.width == 0
    assert median.name == "c 129-step median" and median.line.dash == "dot"
    assert all(t.legendgroup == "c" and t.showlegend is False for t in (shape, median))
    n = len(median.x)
    assert len(shape.x) == 2 * n and list(shape.x[:n]) == list(median.x) and list(shape.x[n:]) == list(median.x[::-1])
    upper, lower = np.asarray(shape.y[:n], float), np.asarray(shape.y[n:][::-1], float)
    assert (upper > lower).all()
    assert [t.name for t in fig.data if t.showlegend is not False] == ["c", "r0", "r1", "r2"]
    assert "▒ band tested" in fig.layout.legend.title.text
    # drawn as tested: the dotted median leaves the fill at the alert step, where the diamond is
    x, lo, hi, med = np.asarray(median.x, float), lower, upper, np.asarray(median.y, float)
    out = (med < lo - 1e-6) | (med > hi + 1e-6)
    assert x[np.flatnonzero(out)[0]] == d.alert_step
    # delta mode: the band is around the detector's centre, not the references' mean: not drawn
    delta = metric_figure("m", runs, reference_ids=[t.run_id for t in refs], bands={"c": band},
                          options=ChartOptions(delta=True))
    assert not [t for t in delta.data if t.fill] and "band" not in (delta.layout.legend.title.text or "")


def test_a_chart_shades_the_bands_of_the_first_three_candidates_to_alert_and_says_so():
    # five candidates shifted from different steps: 5 overlapping bands in one panel could not be told apart
    from rldiag.app.analysis.comparison import BANDS_PER_CHART, tested_bands
    from rldiag.app.data.histories import Histories
    from rldiag.app.plots.figures import metric_figure

    rng = np.random.default_rng(11)
    refs = [_trace(f"r{i}", 1 + SD * _ar(rng)) for i in range(3)]
    cands = {}
    for i, start in enumerate([300, 120, 250, 160, 200]):
        v = 1 + SD * _ar(rng)
        v[start:] += 8 * SD
        cands[f"c{i}"] = _trace(f"c{i}", v)
    divs = {c: detect_divergence(refs, t) for c, t in cands.items()}
    assert all(d.diverged and d.lead.kind == "level" for d in divs.values())
    alerts = {c: d.lead.alert_step for c, d in divs.items()}
    traces = {(t.run_id, "m"): t for t in [*refs, *cands.values()]}
    h = Histories("memory", "memory", traces, tuple(r for r, _ in traces), dict(traces), {}, {})
    bands = tested_bands(h, "m", [t.run_id for t in refs], divs)
    assert BANDS_PER_CHART == 3 and len(bands) == 3
    assert sorted(bands) == sorted(sorted(alerts, key=alerts.get)[:3])  # c1, c3, c4: shifted first
    assert len(tested_bands(h, "m", [t.run_id for t in refs], divs, limit=None)) == 5
    runs = {**{t.run_id: t for t in refs}, **cands}
    fig = metric_figure("m", runs, reference_ids=[t.run_id for t in refs], divergences=divs, bands=bands)
    assert len([t for t in fig.data if t.fill == "toself"]) == 3
    assert fig.layout.title.text == "m · bands of the first 3 of 5 to alert"
    # every candidate still has its alert diamond
    assert len([t for t in fig.data if t.name.startswith("diverges: ")]) == 5
    # all of them banded (no limit): no note
    every = tested_bands(h, "m", [t.run_id for t in refs], divs, limit=None)
    assert metric_figure("m", runs, reference_ids=[t.run_id for t in refs], divergences=divs,
                         bands=every).layout.title.text == "m"
