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
