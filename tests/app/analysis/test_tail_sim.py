"""The references' noise simulated for the bars' tails (app/analysis/tail_sim.py): the fitted tail's shape
is the sample's, its level is passed as often as it says on runs it was not fitted on, the simulation keeps
the references' tails, and too few references give no tail (the normal ratio alone)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.signal import lfilter

from rldiag.app.analysis.divergence import DivergenceConfig
from rldiag.app.analysis.tail_sim import (
    MIN_INNOVATIONS,
    _gpd_pwm,
    fit_tail,
    gap,
    innovations,
    simulate,
    simulated_tails,
)
from rldiag.app.analysis.trailing_stats import _trailing_median


@pytest.mark.parametrize("xi", [-0.2, 0.0, 0.3])
def test_the_fitted_shape_is_the_samples(xi):
    u = np.random.default_rng(3).uniform(size=4000)
    y = -np.log(u) * 2 if xi == 0 else 2 * (u ** (-xi) - 1) / xi  # generalised Pareto, scale 2
    got, sigma = _gpd_pwm(y)
    assert abs(got - xi) < 0.08 and abs(sigma - 2) < 0.3, (got, sigma)


@pytest.mark.parametrize("dof,phi", [(3, 0.0), (3, 0.8), (None, 0.5)])
def test_the_level_is_passed_as_often_as_it_says_on_runs_it_was_not_fitted_on(dof, phi):
    """Fitted on 50k points of a trailing 11-median, the level its maximum over 1000 points passes with
    probability 5% is passed by about 5% of 1000 fresh 1000-point runs (what a bar at the target needs)."""
    rng = np.random.default_rng(7)
    e = rng.standard_t(dof, 1_050_000) if dof else rng.standard_normal(1_050_000)
    z = np.abs(_trailing_median(lfilter([1.0], [1.0, -phi], e), 11))
    tail = fit_tail(z[:50_000], gap(11, phi))
    level = tail.level(0.05, 1000)
    fresh = z[50_000:].reshape(1000, 1000)[:, 11:].max(axis=1)
    passed = float(np.mean(fresh > level))
    assert 0.025 <= passed <= 0.09, (passed, level, tail)


def test_the_simulation_keeps_the_references_tails_and_is_the_same_each_time():
    rng = np.random.default_rng(11)
    refs = [lfilter([1.0], [1.0, -0.7], rng.standard_t(3, 2000)) for _ in range(2)]
    innov = innovations(refs, 0.7)
    assert innov.size == 2 * 1999 and abs(innov.mean()) < 1e-12
    sim = simulate(innov, 0.7, 40_000)
    back = sim[1:] - 0.7 * sim[:-1]
    # every simulated innovation is one of theirs (resampled), the largest as large as theirs
    assert np.isin(np.round(back, 9), np.round(innov, 9)).mean() > 0.999
    assert np.abs(back).max() == pytest.approx(np.abs(innov).max(), rel=0.5)
    assert np.array_equal(sim, simulate(innov, 0.7, 40_000))


def test_heavier_noise_carries_further_and_few_points_give_no_tail():
    config = DivergenceConfig()
    rng = np.random.default_rng(5)

    def tails(e):
        refs = [lfilter([1.0], [1.0, -0.5], x) for x in e]
        return simulated_tails(refs, 0.5, config, lambda m: float(np.std(_trailing_median(refs[0], m)[m:])),
                               (1.0, 1.0), lambda x: x)

    normal = tails([rng.standard_normal(3000) for _ in range(3)])
    heavy = tails([rng.standard_t(1.5, 3000) for _ in range(3)])
    assert set(normal) == {*config.windows, ("change", 11), ("change", 21)}
    assert heavy[11].ratio(0.001, 100_000, 9000) > normal[11].ratio(0.001, 100_000, 9000)
    assert tails([rng.standard_normal(MIN_INNOVATIONS // 2)]) == {}


def test_a_negative_tail_points_is_refused_with_the_fix_and_zero_turns_the_simulation_off():
    with pytest.raises(ValueError, match=r"tail_points=-5: use 0 \(normal noise's ratio alone\) .* e.g. 50000"):
        DivergenceConfig.from_options(["tail_points=-5"])
    rng = np.random.default_rng(2)
    refs = [lfilter([1.0], [1.0, -0.5], rng.standard_t(2, 3000)) for _ in range(2)]
    on = simulated_tails(refs, 0.5, DivergenceConfig(), lambda m: 1.0, (1.0, 1.0), lambda x: x)
    assert on and simulated_tails(refs, 0.5, DivergenceConfig(tail_points=0), lambda m: 1.0, (1.0, 1.0),
                                  lambda x: x) == {}
    # a simulation too short for any window to fill (nor 30 excursions): no tail, and no error
    assert simulated_tails(refs, 0.5, DivergenceConfig(tail_points=5), lambda m: 1.0, (1.0, 1.0), lambda x: x) == {}


def test_a_top_is_carried_by_the_simulated_ratio_only_where_it_reaches_further():
    from rldiag.app.analysis.calibration import Calibration, span, z_seen
    from rldiag.app.analysis.tail_sim import Tail

    cal = Calibration(0.001, 10_000, 30_000, 0.5)
    normal = cal.extrapolate(11, 4.0)
    assert normal == pytest.approx(4.0 * cal.model(11) / z_seen(30_000 / span(11, 0.5)))
    heavy, light = Tail(3.0, 0.002, 0.3, 0.5), Tail(3.0, 0.002, -0.3, 0.2)
    cal.tails = {11: heavy, ("change", 11): light}
    assert 4.0 * heavy.ratio(0.001, 10_000, 30_000) > normal
    assert cal.extrapolate(11, 4.0) == pytest.approx(4.0 * heavy.ratio(0.001, 10_000, 30_000))
    assert cal.extrapolate(11, 4.0, test=("change", 11)) == pytest.approx(normal)  # lighter: normal noise's
    assert cal.extrapolate(21, 4.0) == pytest.approx(cal.extrapolate(21, 4.0, test=21))  # no tail: normal's
