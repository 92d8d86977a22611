"""`impulse_clip` (10 by default: trailing_stats.clean_impulses): one huge heavy-tailed noise innovation echoes
for 10-20 steps under autocorrelated noise and reads as a shift; cleaned, it is one point, and a lasting shift is still
found soon after it starts."""

from __future__ import annotations

import numpy as np
import pytest

from rldiag.app.analysis.detector import clean_impulses
from rldiag.app.analysis.divergence import DivergenceConfig, detect_divergence
from tests.helpers.divergence import trace

PHI = 0.75
INNOV = np.sqrt(1 - PHI**2)  # innovation sd of AR(1) noise of sd 1


def _ar(rng: np.random.Generator, n: int, shock_at: int | None = None, shock: float = 0.0) -> np.ndarray:
    e = rng.normal(0, INNOV, n)
    if shock_at is not None:
        e[shock_at] += shock
    x = np.zeros(n)
    for i in range(1, n):
        x[i] = PHI * x[i - 1] + e[i]
    return x


def test_an_innovation_beyond_the_clip_keeps_its_point_and_its_echo_is_taken_out():
    rng = np.random.default_rng(1)
    base = _ar(rng, 400)
    echo = base + 40 * INNOV * PHI ** np.clip(np.arange(400) - 200, 0, None) * (np.arange(400) >= 200)
    out = clean_impulses(echo, PHI, INNOV, 6.0)
    # causal, and the impulse is one point: its next innovation (ordinary) says it was a jump
    assert np.allclose(out[:201], echo[:201])
    k = np.arange(1, 200)
    # what is left of it after: at most the clip (and the noise's own innovation there), decaying as the noise does
    assert np.all(np.abs(out[201:] - base[201:]) <= 9 * INNOV * PHI**k + 1e-9)
    assert abs(echo[205] - base[205]) > 6  # uncleaned, 5 steps on it is still 7 sd out


def test_a_lasting_shift_is_rebuilt_at_the_noises_pace():
    rng = np.random.default_rng(2)
    base = _ar(rng, 400)
    out = clean_impulses(base + 5.0 * (np.arange(400) >= 200), PHI, INNOV, 6.0)
    assert np.mean(out[230:] - base[230:]) > 4.9  # all of it, 30 steps on
    assert out[205] - base[205] > 4.0  # most of it 5 steps on


def test_a_spike_at_the_first_point_or_after_a_gap_leaves_the_points_after_it_as_they_are():
    # no point before it: it is judged on its own (in the noise's stationary sd); its next innovation is -phi
    # times it, so it was a spike: nothing is taken out after it (as an innovation, its echo taken out would
    # have pushed the next steps ~18 sd down, and the way back, taken for a shock, up)
    rng = np.random.default_rng(3)
    base = _ar(rng, 300)
    spiked = base.copy()
    spiked[0] += 30.0
    spiked[150] = np.nan
    spiked[151] += 30.0
    out = clean_impulses(spiked, PHI, INNOV, 6.0)
    assert np.allclose(out, spiked, equal_nan=True)


def test_an_echo_of_one_huge_innovation_is_no_departure_with_impulse_clip():
    # 3 references and a candidate of the same AR(0.75) noise, the candidate with one 40-sd innovation at
    # step 300. Measured: off, 17 of these 20 are level departures; impulse_clip=10 (README), 5; 6, 2.
    on, off = DivergenceConfig(), DivergenceConfig(impulse_clip=0.0)
    fired = {"on": 0, "off": 0}
    for seed in range(20):
        rng = np.random.default_rng(900 + seed)
        refs = [trace(10 + _ar(rng, 600), f"r{i}") for i in range(3)]
        c = trace(10 + _ar(rng, 600, 300, 40 * INNOV))
        fired["off"] += detect_divergence(refs, c, off).diverged
        d = detect_divergence(refs, c, on)
        fired["on"] += d.diverged
        if d.diverged:
            assert d.alert_step >= 300, d.departures
    assert fired["off"] >= 15 and fired["on"] <= 6, fired


def _shift_delays(cfg: DivergenceConfig) -> list[int]:
    """Steps from a 5-sd lasting shift at step 300 to its alert, on 20 draws of 3 references and a candidate."""
    delays = []
    for seed in range(20):
        rng = np.random.default_rng(900 + seed)
        refs = [trace(10 + _ar(rng, 600), f"r{i}") for i in range(3)]
        c = 10 + _ar(rng, 600)
        c[300:] += 5.0
        d = detect_divergence(refs, trace(c), cfg)
        assert d.diverged and d.kind == "level" and d.first.delta > 0, (cfg.impulse_clip, seed, d.departures)
        assert d.alert_step >= 300
        delays.append(d.alert_step - 300)
    return delays


def test_a_5_sd_shift_is_still_found_soon_after_it_starts_with_impulse_clip():
    # its first innovation is 7.6 innovation sd: under a clip of 10 nothing is cut, and every alert is as
    # soon as without it (measured: a median of 5.5 steps). A clip of 6 cuts it, and the rest comes back at
    # the noise's pace: a median of 8.5 steps, none more than 5 later
    off = _shift_delays(DivergenceConfig(impulse_clip=0.0))
    later = np.subtract(_shift_delays(DivergenceConfig()), off)
    assert later.min() >= 0 and later.max() <= 1, later
    six = _shift_delays(DivergenceConfig(impulse_clip=6.0))
    later = np.subtract(six, off)
    assert later.min() >= 0 and later.max() <= 6 and np.median(six) <= 10, six


def test_impulse_clip_below_0_or_nan_is_refused_with_the_value():
    with pytest.raises(ValueError, match=r"impulse_clip=-1.0: use 0 \(off\) or .* e.g. 10"):
        DivergenceConfig.from_options(["impulse_clip=-1"])
    with pytest.raises(ValueError, match="impulse_clip=nan"):
        DivergenceConfig(impulse_clip=float("nan"))


def test_impulses_found_a_chunk_at_a_time_are_those_found_over_the_whole_rest(monkeypatch):
    # after a shift, _impulse_cuts finds the shifted level's impulses a chunk at a time (the whole rest at each
    # shift took 0.15-0.3 s a detection of a drifting candidate): the cleaned series must not depend on the chunk
    from rldiag.app.analysis import trailing_stats as T

    rng = np.random.default_rng(7)
    series = [np.cumsum(rng.normal(size=20_000))]  # far from the centre: an impulse at most steps, many shifts
    for phi in (0.3, 0.6, 0.85):  # shifts of 100-400 sd (each later innovation out) among spikes at 5% of steps
        x = T.ar1_filter(rng.standard_t(3, 3000) * np.sqrt(1 - phi**2), phi)
        for at in rng.choice(3000, 6, replace=False):
            x[at:] += rng.choice([-1, 1]) * rng.uniform(100, 400)
        hit = rng.random(3000) < 0.05
        x[hit] += rng.choice([-1, 1], hit.sum()) * rng.uniform(15, 60, hit.sum())
        series.append(x)
    for x in series:
        for phi in (0.3, 0.6, 0.85):
            monkeypatch.setattr(T, "IMPULSE_CHUNK", 1 << 30)
            whole = T.clean_impulses(x, phi, 1.0, 10.0)
            for chunk in (1, 7, 512):
                monkeypatch.setattr(T, "IMPULSE_CHUNK", chunk)
                assert np.array_equal(T.clean_impulses(x, phi, 1.0, 10.0), whole, equal_nan=True), (phi, chunk)
