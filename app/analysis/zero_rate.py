"""The two-part comparison's second part: how often a metric is exactly 0 (`ZeroRate`), tested by
trailing zero fractions and by runs of zeros.

Why (measured on `bench.divergence_rl`, RL-like noise):
- A metric exactly 0 at more than `MAX_ZEROS` of the references' points (a clip rate that is often 0, a
  GRPO loss that is 0 where no group has an advantage) is compared in two parts: its other values, the
  zeros left out (as logs where `noise_transforms` says so), and how often it is exactly 0 (`ZeroRate`:
  trailing zero fractions against the references' local rate, and runs of zeros longer than the
  references': RUN_FACTOR). On its linear scale a third of the points at 0 hid a drop toward 0 from
  the trailing medians, and logs with the zeros far below put a third of the points at the floor.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from rldiag.app.analysis.calibration import Calibration, ar_mean_var
from rldiag.app.analysis.onsets import Stretch
from rldiag.app.analysis.reference_bars import window_bar
from rldiag.app.analysis.trailing_stats import rolling, trailing_mean


class ZeroRate(NamedTuple):
    """The two-part comparison's second part: how often the references are exactly 0."""

    rate: np.ndarray  # per reference step: the references' local fraction of exact zeros (a centred mean)
    phi: float  # lag-1 autocorrelation of the 0/1 indicator around it
    null_sd: tuple[float, ...]  # per trailing window: sd of (candidate's zero fraction - rate) under no change
    threshold: tuple[float, ...]  # per trailing window, in null sd (>= k; self-calibrated as the level bars)
    run_bar: int = 0  # steps in a row exactly 0 that are a departure wherever the rate is (RUN_FACTOR x the references' longest)
    spread: float = 0.0  # sd of the seed-to-seed difference of the rate
    points: int = 0  # the references' most points (how many chances a run had there)


def zero_indicator(values: np.ndarray) -> np.ndarray:
    """1 where a value (of `finite_values`) is exactly 0, 0 where it is another finite value, NaN elsewhere."""
    return np.where(np.isfinite(values), (values == 0).astype(float), np.nan)


def _zero_rate(raw: np.ndarray, config) -> ZeroRate:
    """How often the references are exactly 0, and how far a candidate's trailing zero fraction strays
    from it under no change: binomial noise with the indicator's autocorrelation, the centre's own error
    and the seed-to-seed spread of the rate (from the seeds, shrunk towards a prior of `zero_seed_spread`
    sd of one step's 0/1). Each window's bar rises above what the references reach on it, their own
    wander and (2 or more seeds) each left out against the others, as the level bars do."""
    z = zero_indicator(raw)
    n, w = z.shape[1], config.detrend_window
    own = rolling(z, w, "mean", center=True, min_periods=1)  # each seed's local rate
    rate = np.nanmean(own, axis=1)
    p = float(np.nanmean(z))
    var1 = max(p * (1 - p), 1e-12)
    res = z - own
    lag = res[1:] * res[:-1]
    phi = float(np.clip(np.nansum(lag) / np.nansum(res[1:] ** 2), 0.0, 0.95)) if np.nansum(res[1:] ** 2) > 0 else 0.0
    est = 0.0
    if n >= 2:
        dev = own - rate[:, None]
        est = max(float(np.nanmean(dev**2)) * n / (n - 1) - var1 * ar_mean_var(w, phi), 0.0)
    k0 = config.seed_spread_weight
    spread2 = ((n - 1) * est + k0 * (config.zero_seed_spread**2 * var1)) / (n - 1 + k0)

    def null_sd_of(m: int, seeds: int) -> float:
        seeds = max(seeds, 1)
        v = var1 * ar_mean_var(m, phi) + var1 * ar_mean_var(max(m, w), phi) / seeds + spread2 * (1 + 1 / seeds)
        return float(np.sqrt(v))

    loo = [0.0] * len(config.windows)
    if n >= 2:
        for j in range(n):
            rj = z[:, j] - np.nanmean(np.delete(own, j, axis=1), axis=1)
            for wi, m in enumerate(config.windows):
                zz = trailing_mean(rj, m) / null_sd_of(m, n - 1)
                if np.isfinite(zz).any():
                    loo[wi] = max(loo[wi], float(np.nanmax(np.abs(zz))))
    counts = np.isfinite(z).sum(axis=0)
    cal = Calibration(config.alpha, int(counts.max()), int(counts.sum()), phi) if config.alpha > 0 else None
    null_sd, thresholds = [], []
    for wi, m in enumerate(config.windows):
        sd = null_sd_of(m, n)
        own_sd = float(np.sqrt(var1 * ar_mean_var(m, phi)))
        top = 0.0
        for j in range(n):
            tm = trailing_mean(res[:, j], m)
            if np.isfinite(tm).any():
                top = max(top, float(np.nanmax(np.abs(tm))) / own_sd)
        null_sd.append(sd)
        thresholds.append(window_bar(config, m, top, own_sd / sd, loo[wi], cal))
    longest = max(longest_zero_run(z[:, j]) for j in range(n))
    return ZeroRate(rate, phi, tuple(null_sd), tuple(thresholds), int(np.ceil(RUN_FACTOR * max(longest, 1))),
                    float(np.sqrt(spread2)), max(int(np.isfinite(z).sum(axis=0).max()), 2))


# A run of steps exactly 0 is a departure once it is RUN_FACTOR times the longest the references show, and
# as long as would happen by chance once in 1/RUN_ALPHA runs as long as theirs, with independent steps at
# the references' local rate where it starts (2 sd of the seeds' spread of the rate above it). A metric
# that stops being anything but 0 (a clip rate that dies: no update moves the policy) is found long before
# a trailing fraction clears the seeds' spread of the rate. Only runs of zeros: runs of non-zero values are
# long wherever the rate falls (a reward that stops being 0 as a run learns), and a seed that learns
# faster made them longer than its references' (8 of 40 flagged on a scratch probe).
RUN_FACTOR, RUN_ALPHA = 2.0, 1e-3


def longest_zero_run(z: np.ndarray) -> int:
    """The longest run of 1 in a 0/1 series (missing steps are skipped)."""
    x = z[np.isfinite(z)]
    edges = np.flatnonzero(np.diff(np.r_[False, x == 1, False].astype(np.int8)))
    return int(np.max(edges[1::2] - edges[::2])) if len(edges) else 0


def chance_run(rate: float, points: int) -> float:
    """Length of a run of zeros that independent steps at `rate` make once in 1/RUN_ALPHA runs of `points`."""
    if not 0 < rate < 1:
        return np.inf if rate >= 1 else 1.0
    return float(np.log(RUN_ALPHA / (points * (1 - rate))) / np.log(rate))


def _run_stretches(zero_ind: np.ndarray, zero_rate: np.ndarray, zeros: ZeroRate) -> list[Stretch]:
    """zero_rate departures of runs of exactly 0 too long for the references (see RUN_FACTOR): alerted
    where the run reaches its bar, from the run's first step to its last."""
    out = []
    x = np.nan_to_num(zero_ind, nan=-1.0)  # a missing step ends a run (it is not compared)
    edges = np.flatnonzero(np.diff(np.r_[False, x == 1, False].astype(np.int8)))
    for a, b in zip(edges[::2], edges[1::2]):  # the run is [a, b)
        if b - a < zeros.run_bar:
            continue
        local = min(float(zero_rate[a]) + 2 * zeros.spread, 0.999) if np.isfinite(zero_rate[a]) else 0.999
        bar = int(np.ceil(max(zeros.run_bar, chance_run(local, zeros.points), 2)))
        if b - a >= bar:
            out.append(Stretch("zero_rate", int(a), int(a + bar - 1), None if b == len(x) else int(b - 1), 1, bar))
    return out
