"""Bars from a target false-alarm probability (issue 43): the model's bar holds its rate on simulated
AR(1) noise of any length, and what the references reach raises it where their tails are heavier."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.signal import lfilter

from rldiag.app.analysis.calibration import Calibration, span, z_alpha, z_seen
from rldiag.app.analysis.detector import _trailing_median, ar_mean_var, median_var, reference_model
from rldiag.app.analysis.divergence import DivergenceConfig
from rldiag.app.data.trace import Trace


def _ar(rng: np.random.Generator, n: int, phi: float, runs: int) -> np.ndarray:
    e = rng.standard_normal((runs, n)) * np.sqrt(1 - phi**2)
    e[:, 0] = rng.standard_normal(runs)
    return lfilter([1.0], [1.0, -phi], e, axis=1)


def test_the_bar_grows_with_the_run_as_the_largest_of_its_looks_does():
    bars = [Calibration(1e-3, n, n, 0.6).model(11) for n in (1_000, 10_000, 100_000)]
    assert bars[0] < bars[1] < bars[2] < bars[0] + 1.5
    assert z_alpha(1e-3, 1) > 3.29  # beyond the two-sided 0.1% of one value: a window crosses more often
    assert span(11, 0.0) == pytest.approx(11) and 11 < span(11, 0.6) < 11 * 4
    assert z_seen(1) < z_alpha(1e-3, 1)


@pytest.mark.parametrize("phi, n", [(0.0, 3_000), (0.6, 3_000), (0.85, 20_000)])
def test_the_model_bar_holds_its_false_alarm_rate_on_normal_ar1_noise(phi, n):
    # alpha 0.2 so that 150 simulated runs can tell: the share of runs whose trailing 11-median ever
    # crosses the bar is near alpha (at most it; the looks are counted conservatively), at any length
    rng = np.random.default_rng(7)
    m, alpha = 11, 0.2
    sd = np.sqrt(median_var(phi) * ar_mean_var(m, phi))
    bar = Calibration(alpha, n, n, phi).model(m)
    x = _ar(rng, n, phi, 150)
    crossed = np.mean([np.nanmax(np.abs(_trailing_median(r, m))) / sd > bar for r in x])
    assert 0.02 <= crossed <= alpha * 1.25, (crossed, bar)


def test_a_reference_s_heavy_tail_raises_the_bar_by_its_largest_excursion():
    cal = Calibration(1e-3, 1_000, 1_000, 0.6)
    typical = z_seen(1_000 / span(11, 0.6))
    assert cal.extrapolate(11, typical) == pytest.approx(cal.model(11))  # normal noise: the model's bar
    assert cal.bar(11, 2 * typical) == pytest.approx(2 * cal.model(11))  # twice as far: twice the bar
    assert cal.extrapolate(11, 0.0) == 0.0


def _trace(values: np.ndarray, run: str) -> Trace:
    return Trace(run, "m", "m", np.arange(len(values), dtype=np.int64), values, np.zeros(len(values), np.int64))


def test_long_references_get_higher_bars_than_short_ones_of_the_same_noise():
    rng = np.random.default_rng(3)
    config = DivergenceConfig(alpha=1e-3)
    bars = []
    for n in (1_000, 50_000):
        refs = tuple(_trace(10 + r, f"r{j}") for j, r in enumerate(_ar(rng, n, 0.3, 2)))
        bars.append(reference_model(refs, config).noise)
    short, long = bars
    assert all(b >= a for a, b in zip(short.threshold, long.threshold))
    # the longest window and the change tests: above their floors (k, k_change_loo) at 50k steps
    assert long.threshold[-1] > short.threshold[-1] and long.change_bar[0] > short.change_bar[0]
    fixed = reference_model(tuple(_trace(10 + r, f"r{j}") for j, r in enumerate(_ar(rng, 50_000, 0.3, 2))),
                            DivergenceConfig(alpha=0.0)).noise
    assert fixed.threshold[-1] == pytest.approx(DivergenceConfig().k)  # alpha 0: the fixed bar at any length


def test_alpha_must_be_a_probability():
    with pytest.raises(ValueError, match="alpha=1.5: use a false-alarm probability"):
        DivergenceConfig(alpha=1.5)
