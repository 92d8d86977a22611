"""Onsets with a stated error (issue 43 item 3): real detector calls on generated AR(1) traces."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.signal import lfilter

from rldiag.app.analysis.divergence import DivergenceConfig, compute_band, detect_divergence
from rldiag.app.analysis.onsets import first_out
from rldiag.app.data.trace import Trace

T, AT = 400, 200


def _noise(rng: np.random.Generator, phi: float = 0.5) -> np.ndarray:
    return lfilter([1.0], [1.0, -phi], rng.standard_normal(T) * np.sqrt(1 - phi**2))


def _trace(values: np.ndarray, run: str) -> Trace:
    return Trace(run, "m", "m", np.arange(len(values), dtype=np.int64), np.asarray(values, float),
                 np.zeros(len(values), np.int64))


def _pair(seed: int, phi: float = 0.5) -> tuple[list[Trace], np.ndarray]:
    rng = np.random.default_rng(seed)
    refs = [_trace(10 + _noise(rng, phi), f"ref{j}") for j in range(3)]
    return refs, 10 + _noise(rng, phi)


@pytest.mark.parametrize("seed", range(6))
def test_a_lasting_5sd_shift_starts_within_2_steps(seed):
    refs, cand = _pair(seed)
    cand[AT:] += 5.0 * (1 if seed % 2 else -1)
    d = detect_divergence(refs, _trace(cand, "cand"))
    assert d.diverged and d.kind == "level", d.departures
    assert abs(d.onset_step - AT) <= 2, (d.onset_step, d.alert_step)


@pytest.mark.parametrize("seed", range(6))
def test_the_onset_is_a_point_out_of_the_band(seed):
    """Never before the first point out: the candidate's own point at the onset is outside the band drawn
    by default (the longest window's, its half-width where the window is full), and within 10 steps."""
    refs, cand = _pair(100 + seed, phi=0.7)
    cand[AT:] += 3.0
    d = detect_divergence(refs, _trace(cand, "cand"))
    assert d.diverged and d.alert_step >= AT and d.onset_step >= AT - 10, d.departures
    band = compute_band(refs, _trace(cand, "cand"), DivergenceConfig())[0]
    half = band.upper[-1] - band.center[-1]
    assert cand[d.onset_step] > band.center[d.onset_step] + half, (d.onset_step, cand[d.onset_step], half)


@pytest.mark.parametrize("seed", range(4))
def test_a_burst_before_a_shift_does_not_pull_the_onset_back(seed):
    refs, cand = _pair(200 + seed)
    cand[AT - 20:AT - 17] += 6.0  # a 3-step burst 20 steps before a lasting 5-sd shift the same way
    cand[AT:] += 5.0
    d = detect_divergence(refs, _trace(cand, "cand"))
    assert d.diverged and abs(d.onset_step - AT) <= 2, d.departures


@pytest.mark.parametrize("seed", range(4))
def test_a_spike_before_a_variance_change_does_not_pull_its_onset_back(seed):
    refs, cand = _pair(400 + seed, phi=0.0)
    cand[AT - 10] += 25.0  # one spike: two step-to-step changes far beyond the variance band
    cand[AT:] += np.random.default_rng(seed).normal(0, 3.0, T - AT)
    d = detect_divergence(refs, _trace(cand, "cand"))
    var = [x for x in d.departures if x.kind == "variance"]
    assert var and var[0].onset_step >= AT - 2, d.departures


def test_first_out_skips_points_before_a_run_inside():
    x = np.zeros(40)
    x[[5, 6]] = 3.0  # out, then 11 points inside (the gap): evidence ended
    x[18:] = 3.0
    assert first_out(x, 0, 39, 2.0, gap=11) == 18
    assert first_out(x, 0, 39, 2.0, gap=12) == 5  # a shorter run inside does not end it
    assert first_out(x, 7, 39, 2.0, gap=11) == 18  # never before the split
    assert first_out(np.zeros(40), 0, 39, 2.0, gap=11) == 39  # none out: the alert
