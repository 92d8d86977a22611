"""How far a test's statistic reaches under the references' own noise, simulated (issue 43 item 1).

`calibration.Calibration` carries the largest value the references reach to the target false-alarm
probability by the ratio normal noise has between the two (`z_alpha / z_seen`). Under heavy-tailed
or bursty noise the maximum grows faster with the run than under normal noise, so a top carried by the
normal ratio is too low where the candidate is long or the target is far: on unseen seeds of
bench.divergence_length (three ranges drawn alike, 2026-12-07) 5-6% of no-change candidate x metric pairs
were flagged against a target of 0.1%, 9 of 11 flagged seeds on short-window departures 5-10 steps after a
cluster of large innovations the references had too, only not two in a row.

Here that ratio comes from the references themselves:
- **The noise, simulated.** The references' AR(1) innovations (their residual points, before impulse
  cleaning: `innovations`) are resampled in blocks of `BLOCK` steps (a block bootstrap: bursts and
  clusters of large innovations stay together, and meet in new combinations), run through the AR(1)
  filter at their phi and cleaned as a candidate is (`simulate`): `DivergenceConfig.tail_points` points with the
  references' tails, clusters and autocorrelation, without a model for any of them.
- **The tail, fitted.** Each test's |statistic| over the simulated run is declustered (exceedances
  closer than its span are one excursion) and the `PEAKS` highest excursions are fitted with a generalised
  Pareto tail (probability-weighted moments, Hosking & Wallis 1987; no optimiser): `fit_tail`. Its shape
  says how fast the maximum grows with the run (0: as normal noise's, > 0: heavier).
- **The ratio.** `Tail.level(p, length)`: the level the statistic's maximum over `length` points passes
  with probability p. The bars use level(alpha, candidate's length) / level(1/2, points the references'
  tops were taken over), where it is more than the normal ratio.
Deterministic (a fixed seed): the same references give the same bars. Where the references hold fewer
than `MIN_INNOVATIONS` innovations (one short reference cannot show its tails), or a test's simulated run
holds too few excursions, the normal ratio alone is used, as before this module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from rldiag.app.analysis.trailing_stats import _trailing_median, ar1_filter, change_z

BLOCK = 8  # innovations resampled together: a burst of up to this many steps stays one
PEAKS = 100  # excursions the tail is fitted on
MIN_INNOVATIONS = 200  # fewer: the references cannot show their tails, the normal ratio alone
XI_RANGE = (-0.5, 0.5)  # the fitted shape is kept in this range (beyond: one odd excursion's say)
SEED = 20261207


@dataclass(frozen=True)
class Tail:
    """A generalised Pareto tail over `u0`: `rate` excursions beyond it per point, shape `xi`, scale
    `sigma`."""

    u0: float
    rate: float
    xi: float
    sigma: float

    def level(self, p: float, length: float) -> float:
        """The level the statistic's maximum over `length` points passes with probability `p` (excursions
        as a Poisson count: 1 - exp(-length rate (1 + xi y / sigma)^(-1 / xi)) = p). Below `u0` the fit
        says nothing: NaN there."""
        r = -math.log1p(-p) / (max(length, 1.0) * self.rate)
        if r > 1:
            return math.nan
        if abs(self.xi) < 1e-6:
            return self.u0 - self.sigma * math.log(r)
        return self.u0 + self.sigma / self.xi * (r ** (-self.xi) - 1.0)

    def ratio(self, alpha: float, length: float, seen: float) -> float:
        """level(alpha, length) / level(1/2, seen): how much further the maximum over a candidate of
        `length` reaches at the target than the references' own reached over the `seen` points scored."""
        hi, mid = self.level(alpha, length), self.level(0.5, seen)
        return hi / mid if mid > 0 and math.isfinite(hi) and math.isfinite(mid) else math.nan


def innovations(pts: list[np.ndarray], phi: float) -> np.ndarray:
    """Every finite AR(1) innovation (x_t - phi x_(t-1)) of the references' residual points, centred."""
    out = [u[np.isfinite(u)] for x in pts if len(x) > 2 for u in [x[1:] - phi * x[:-1]]]
    innov = np.concatenate(out) if out else np.empty(0)
    return innov - innov.mean() if innov.size else innov


def simulate(innov: np.ndarray, phi: float, n: int, block: int = BLOCK, seed: int = SEED) -> np.ndarray:
    """`n` points of AR(1) noise at `phi` driven by `innov` resampled in blocks of `block`."""
    rng = np.random.default_rng(seed)
    block = max(1, min(block, len(innov)))
    starts = rng.integers(0, len(innov) - block + 1, -(-n // block))
    e = innov[(starts[:, None] + np.arange(block)).ravel()[:n]]
    return ar1_filter(e, phi)


def _gpd_pwm(y: np.ndarray) -> tuple[float, float]:
    """(xi, sigma) of a generalised Pareto fitted to the excesses `y` by probability-weighted moments."""
    y = np.sort(y)
    n = len(y)
    a0 = float(y.mean())
    a1 = float(np.sum((n - 1 - np.arange(n)) / (n - 1) * y) / n)
    d = a0 - 2 * a1
    if not d > 0:
        return XI_RANGE[1], a0
    k = a0 / d - 2  # Hosking and Wallis' k = -xi
    return -k, 2 * a0 * a1 / d


def gap(m: int, phi: float) -> int:
    """Points apart beyond which two values of an m-point window's statistic are about independent: the
    window plus three of the noise's correlation lengths."""
    return m + math.ceil(3 / (1 - min(max(phi, 0.0), 0.95)))


def fit_tail(z: np.ndarray, apart: int, peaks: int = PEAKS) -> Tail | None:
    """The tail of |z| (a test's statistic along a run): its excursions (points beyond a low threshold,
    those fewer than `apart` points apart one), the `peaks` highest fitted (fewer where the run holds
    fewer than 2 x `peaks` excursions, at least 30). None where there are too few."""
    z = np.abs(z[np.isfinite(z)])
    if len(z) < 20 * 30:  # fewer points than 30 excursions' worth: nothing to fit
        return None
    low = float(np.quantile(z, 0.9))
    idx = np.flatnonzero(z > low)
    if len(idx) < 2:
        return None
    starts = np.r_[0, np.flatnonzero(np.diff(idx) > apart) + 1]
    tops = np.maximum.reduceat(z[idx], starts)
    peaks = min(peaks, (len(tops) - 1) // 2)
    if peaks < 30:
        return None
    tops = np.sort(tops)[::-1]
    u0 = float(tops[peaks])
    y = tops[:peaks] - u0
    if not (y > 0).any():
        return None
    xi, sigma = _gpd_pwm(y)
    if not XI_RANGE[0] <= xi <= XI_RANGE[1]:  # kept in range, the scale from the mean excess: sigma / (1 - xi)
        xi = min(max(xi, XI_RANGE[0]), XI_RANGE[1])
        sigma = float(y.mean()) * (1 - xi)
    return Tail(u0, peaks / len(z), xi, max(sigma, 1e-12))


def simulated_tails(pts: list[np.ndarray], phi: float, config, own_sd, change_sd: tuple[float, ...], clean) -> dict:
    """Per test, the tail of its statistic on the references' noise simulated (`simulate`) and cleaned
    (`clean`, as a candidate is): each level window's |trailing median| in its own-noise sd (`own_sd(m)`,
    the unit the references' own tops are in) under its m, each change test's |recent - before| in its
    `change_sd` under ("change", q). Empty where the references hold fewer than MIN_INNOVATIONS or
    `config.tail_points` is 0."""
    innov = innovations(pts, phi)
    if config.tail_points <= 0 or innov.size < MIN_INNOVATIONS or not np.ptp(innov) > 0:
        return {}
    sim = clean(simulate(innov, phi, config.tail_points))
    med: dict[int, np.ndarray] = {}

    def trailing(m: int) -> np.ndarray:
        if m not in med:
            med[m] = _trailing_median(sim, m)
        return med[m]

    tails: dict = {}
    for m in config.windows:
        if (sd := own_sd(m)) > 0 and (t := fit_tail(trailing(m) / sd, gap(m, phi))) is not None:
            tails[m] = t
    for (q, p), sd in zip(config.change_windows, change_sd):
        if sd > 0:
            if (t := fit_tail(change_z(trailing(q), trailing(p), q, sd), gap(q + p, phi))) is not None:
                tails[("change", q)] = t
    return tails
