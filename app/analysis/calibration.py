"""The detector's bars from a target false-alarm probability (issue 43).

`DivergenceConfig.alpha` is the chance that a no-change candidate of the references' length gets a false
departure on one test of one metric. A statistic tested at every position of a run of L points is the
larger the longer the run: a bar fixed in sd (k = 5) is a false-alarm rate that grows with the run (at
100k steps it flagged 23 of 32 held-out no-change candidates of bench.divergence_length).

Each bar is the larger of
- the model's (`z_alpha`): the level u that normal noise crosses with probability alpha over the run. A
  trailing window's statistic stays alike over `span` positions (1 / (1 - its lag-1 correlation): m for
  independent points, about m (1 + phi) / (1 - phi) under AR(1) noise), and since its correlation falls
  linearly it crosses u about u^2 times as often as L / span independent values would (Pickands):
  2 (L / span) u^2 (1 - Phi(u)) = alpha. With L / span alone it was crossed by 65% of simulated runs
  at a target of 20%;
- what the references reach, extrapolated to alpha: the largest |z| their own residuals (and, with 2
  or more, each left out against the others) reach over everything scored, times z_alpha over the
  largest |z| normal noise would reach there (`extrapolate`). Under normal noise the two agree; where
  the references' tails are heavier (t(3) innovations, 11-15 sd impulses decaying over 10 steps, bursts)
  their largest value is larger by that much, and so is the bar. One sample maximum sets it, so it is
  as noisy as one; it needs no rule per kind of noise. The ratio is normal noise's, or where it is more,
  the one the references' own noise has when simulated (`tail_sim`: their innovations resampled in
  blocks, the statistic's tail fitted): under heavy tails and bursts the maximum grows faster with the
  run and the target than under normal noise, and the normal ratio alone left 5-6% of no-change
  candidate x metric pairs flagged on unseen seeds against a target of 0.1%.
The detector keeps its fixed bars (`k`, `k_change`) as floors under these: measured cases in its docstring.
The model's bar is checked by simulation in tests/app/analysis/test_calibration.py (AR(1) noise at phi
0 to 0.85: the share of runs that cross it is near alpha).
"""

from __future__ import annotations

from statistics import NormalDist

import numpy as np


def ar_mean_var(m: int, phi: float) -> float:
    """Variance of the mean of `m` consecutive points of unit-variance AR(1) noise."""
    if phi <= 0:
        return 1.0 / m
    d = np.arange(1, m)
    return float((m + 2 * np.sum((m - d) * phi**d)) / m**2)


# the standard library's (no scipy: the read side runs in .venv-trl11, which has no app extra)
_NORMAL = NormalDist()


def span(m: int, phi: float) -> float:
    """1 / (1 - its lag-1 correlation) for the mean of the last `m` points of unit AR(1) noise: the
    scale over which it stays alike (m for independent points; a step changes it by x_t - x_(t-m),
    variance 2 (1 - phi^m), against m^2 ar_mean_var(m) of its own x 2)."""
    phi = min(max(phi, 0.0), 0.95)
    return m * m * ar_mean_var(m, phi) / (1 - phi**m)


def _level(p: float, blocks: float) -> float:
    """The u at which a normal statistic over `blocks` spans crosses +-u with probability `p`: a moving
    window's statistic is not smooth (its correlation falls linearly, 1 - h / span), so it crosses
    about u^2 times as often as `blocks` independent values would (Pickands' constant for a linear
    fall is 1): 2 blocks u^2 (1 - Phi(u)) = p, solved by a few fixed-point steps."""
    blocks = max(blocks, 1.0)
    u = -_NORMAL.inv_cdf(p / (2 * blocks))
    for _ in range(6):
        u = -_NORMAL.inv_cdf(p / (2 * blocks * max(u * u, 1.0)))
    return u


def z_alpha(alpha: float, blocks: float) -> float:
    """The |z| a normal statistic over `blocks` spans stays under with probability 1 - alpha."""
    return _level(alpha, blocks)


def z_seen(blocks: float) -> float:
    """The median of the largest |z| such a statistic reaches over `blocks` spans."""
    return _level(np.log(2), blocks)


class Calibration:
    """Bars for one set of references: `length` points each (the run a candidate is judged over),
    `scored` points over all seeds (what their own largest values were taken over)."""

    def __init__(self, alpha: float, length: int, scored: int, phi: float):
        self.alpha, self.length, self.scored, self.phi = alpha, max(length, 1), max(scored, 1), phi
        self.tails: dict = {}  # per test (a level window's m, ("change", q)): the simulated noise's `tail_sim.Tail`

    def model(self, m: int) -> float:
        """The model's bar for a statistic over `m` points."""
        return z_alpha(self.alpha, self.length / span(m, self.phi))

    def extrapolate(self, m: int, top: float, scored: int | None = None, test=None) -> float:
        """`top`, the largest |z| the references reach over `scored` points (default all of theirs),
        carried to the candidate's target: x z_alpha / z_seen, or x the ratio the references' simulated
        noise has between the two on `test` (default the m-point level window) where that is more."""
        if not top > 0:
            return 0.0
        scored = scored or self.scored
        ratio = self.model(m) / z_seen(scored / span(m, self.phi))
        tail = self.tails.get(m if test is None else test)
        if tail is not None and (r := tail.ratio(self.alpha, self.length, scored)) > ratio:
            ratio = r
        return top * ratio

    def bar(self, m: int, *tops: float, floor: float = 0.0) -> float:
        """The larger of the model's bar, `floor` and each of `tops` extrapolated."""
        return max(self.model(m), floor, *(self.extrapolate(m, t) for t in tops))
