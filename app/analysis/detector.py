"""The departure test behind `detect_divergence`: a causal scan of the candidate against a noise model
learnt from the references.

Why this shape (measured on `bench.divergence_rl`, RL-like noise):
- RL curves are autocorrelated (AR(1) phi up to ~0.85): a band that treats neighbouring points as
  independent underestimates how far a run of points wanders and fires on one seed in six. The null
  variance of a window's median is computed from the references' own autocorrelation (a structure
  function of their residuals), so persistence means what it says under correlated noise.
- Spikes and short bursts happen in every run: the test is on trailing medians of at least
  `windows[0]` points (a burst of fewer than half a window cannot move them), and the threshold of each
  window rises above the largest value the references' own residuals reach on it (self-calibrating:
  a reference with 4-step bursts makes the 5-point window demand more).
- With 2 or more references, each is also scored as a candidate against the centre of the others over
  its whole run, and every bar rises to what they reach: how far seeds wander apart, and how far a
  longer run reaches (tested at more positions), come from the references themselves.
- Seeds differ by a slow wander and a level offset: a window's null variance has a floor, the
  seed-to-seed spread, estimated from the references' smoothed curves (shrunk towards a prior of
  `seed_spread` noise sd, which is all a single reference can give).
- Positive heavy-tailed metrics (KL, clip rate, grad norm) are compared as logs, where their noise is
  symmetric, when the references' values are positive (but for at most `MAX_ZEROS` exact zeros) and
  their noise is multiplicative: its scale grows with the level, where the level moves 2x or more;
  else the log is the less skewed scale (`_use_log`).
- A metric exactly 0 at more than `MAX_ZEROS` of the references' points (a clip rate that is often 0, a
  GRPO loss that is 0 where no group has an advantage) is compared in two parts: its other values, the
  zeros left out (as logs where the above says so), and how often it is exactly 0 (`ZeroRate`:
  trailing zero fractions against the references' local rate, and runs of zeros longer than the
  references': RUN_FACTOR). On its linear scale a third of the points at 0 hid a drop toward 0 from
  the trailing medians, and logs with the zeros far below put a third of the points at the floor.
- Values on a lattice (counts, k of N tokens, rewards of k/8) are jittered by up to half a quantum, the
  same at each step for every run (`dequantise`): medians of values that are mostly one lattice point
  jump a whole quantum, and flagged a fifth to a half of same-distribution count-like candidates.
- A trailing window holding fewer points than its length (a run's first steps, after a gap) is tested
  with the sd of a median of the points it holds (`partial_sd`), in the candidate as in the references'
  own and left-out scores: a 3-step warm-up burst in the first 6 points no longer reads as a shift.
  Where such a window holds an even count, its statistic is the middle point nearer the centre, not the
  mean of the two (`_even_toward_zero`): a burst of half its points makes one of them. Measured on
  bench.divergence_length `warmup` with 2-4 references (tuning seeds, 1k steps 0-239 and 10k 0-39): of 8
  flagged at steps 5-6, 3 no longer are; the 5 left hold 4 outlying points of 6-7 (a burst and a spike).
- Bars from a target false-alarm rate (`DivergenceConfig.alpha`, default 0.001: the chance that a
  no-change candidate as long as the references gets a false departure on one metric, so a page of 10
  candidates x 8 metrics rarely shows one). A statistic tested at every step of a longer run reaches
  further, so a bar fixed in sd is a rate that grows with the run (at 100k steps it flagged 23 of 32
  held-out no-change candidates of bench.divergence_length). Each bar is at least the level that normal
  AR(1) noise crosses with probability alpha over the references' length (`calibration.Calibration`:
  L / span looks of a statistic that stays alike over `span` steps, crossing u^2 times as often as
  independent values), and at least the largest value the references reach (their own residuals; with 2
  or more, each left out against the others) carried from the run(s) they were measured on to the
  target by the same ratio: heavy tails, bursts and decaying impulses raise it by as much as they reach
  beyond normal noise. `k`, `k_per_halving` and `k_change`/`k_change_loo` stay as floors: with the model
  bar alone (no floor), 1000-step candidates with one reference at phi 0.85 were flagged on a heavy-tailed
  jump the one reference never showed (4 false of 96 on bench.divergence_length --quick; 0 with them).
  alpha = 0: the bars before it (the floors, raised to `calibration_margin` x what the references reach).
- A candidate's residual is its noise less the centre's, and the centre is its references' noise (one
  reference: its own, through a 9-step median). So the tops carried to alpha are also taken on each
  reference's own residual less the centre's half a run away (`paired`): a jump's echo in one, the
  other's noise (or echo) at an unrelated step. Their own residuals alone left the centre out, and with one
  reference a candidate's jump echo plus the centre's noise there, or the reference's echo mirrored, crossed
  bars set by echoes the reference itself held (bench.divergence_length, tuning seeds, one reference
  forced: `--refs 1 --lengths 10000,100000 --kinds none,jump,wander`, 22 -> 14 flagged of 96; 100k seed 1
  reached 8.2 on the (21, 65) change test against 7.8). Level windows as long as the wide smooth or longer
  leave it out: there the top rests on a look or two carried to alpha by up to 8x (1000 steps), and their
  centre's part is slow, in the null sd already; with it, one reference forced, a 1000-step 3-sd shift
  (seed 10, `--lengths 1000 --kinds level3`) was missed, found at 275 steps without. With 2 or more
  references it is not taken: each left out against the centre of the others is that already.
- Causal: the candidate's statistic at step t uses only its points up to t, so the step at which a
  departure is first reported on the full run (`alert_step`) is the one a watcher polling every step
  reports it at. The onset is placed after the fact: a CUSUM split before the alert, then the first
  point from it out of the band (`first_out`, which defines the band), so it is never before the first
  point out; a drift has no sharp start, and its onset is where it and the noise first pass the band.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import pandas as pd

from rldiag.app.analysis.calibration import Calibration, ar_mean_var
from rldiag.app.analysis.onsets import (
    VAR_ONSET_GAP,
    Stretch,
    cusum_onset,
    first_out,
    not_back,
    quiet,
    variance_onset,
)
from rldiag.app.analysis.rolling_median import rolling_median, row_nanmedian
from rldiag.app.data.trace import Trace

_MAD = 1.4826  # MAD -> standard deviation for normal noise
# The smallest noise sd a test is scaled by, per unit of the metric's level (or 1, where its level is
# below 1 and it is 0 or changes sign: `reference_model`): float32's unit roundoff. Trainers compute their metrics in float32 or coarser, so a
# difference under it is rounding. A GRPO loss is a sum of advantages x ratios (order 1) that cancel to
# about 0: a seed whose groups all had equal rewards logged exactly 0 from step 12 on, another seed kept
# its rounding noise (-2e-8), and against the first (a floor of 1e-9) the second was a level departure at
# 5.6 sd (tests/experiments/test_divergence_onsets.py; the case in tests/app/analysis/test_divergence.py).
RESOLUTION = 2.0**-24


def median_var(phi: float) -> float:
    """Variance of a window's median / of its mean: pi/2 for independent normal points, nearer 1 the
    more alike neighbours are (simulated: 1.49, 1.27, 1.18, 1.09 at phi 0, 0.3, 0.6, 0.85)."""
    return 1.0 + 0.5 * (1.0 - phi)
MAX_FLOAT = float(np.finfo(np.float64).max)  # MLflow's stand-in for inf


def finite_values(values: np.ndarray) -> np.ndarray:
    """Values with MLflow's max-float stand-ins read as inf and every non-finite value as NaN."""
    v = np.asarray(values, float)
    return np.where(np.isfinite(v) & (np.abs(v) < MAX_FLOAT), v, np.nan)


def rolling(a: np.ndarray, w: int, how: str, *, center: bool, min_periods: int = 1) -> np.ndarray:
    if how == "median":  # pandas' values, by a rank filter where windows are full and finite
        return rolling_median(a, w, center=center, min_periods=min_periods)
    frame = pd.DataFrame(a)
    r = frame.rolling(w, center=center, min_periods=min(min_periods, w))
    out = getattr(r, how)().to_numpy()
    return out[:, 0] if np.ndim(a) == 1 else out


def _mad(x: np.ndarray) -> float:
    x = x[np.isfinite(x)]
    if len(x) < 2:
        return float("nan")
    return float(_MAD * np.median(np.abs(x - np.median(x))))


class NoiseModel(NamedTuple):
    """What the references say about the noise, in the compared scale (log for positive skewed metrics)."""

    log: bool  # compared as log(value)
    sigma: float  # point noise, one sd (robust)
    phi: float  # lag-1 autocorrelation of the noise (AR(1) fit)
    spread: float  # sd of the seed-to-seed slow difference (wander and offset) of one seed
    n_seeds: int
    null_sd: tuple[float, ...]  # per trailing window: sd of (candidate median - centre) under no change
    change_sd: tuple[float, ...]  # per change_windows pair: sd of (recent median - the one before) under no change
    threshold: tuple[float, ...]  # per trailing window, in null sd (>= k; raised by the references' bursts)
    ref_nonfinite: bool  # some reference logs non-finite values itself
    diff_scale: float  # robust sd of the references' step-to-step changes (what `candidate_scale` measures)
    var_bar: float  # candidate scale / diff_scale that is a variance departure (>= var_ratio; self-calibrated)
    change_bar: tuple[float, ...]  # per change_windows pair, in change sd (>= k_change, k_change_loo with 2+ seeds; self-calibrated)
    fill: float = 1.0  # fraction of the references' points in the compared values (< 1: the two-part comparison's zeros left out)
    innov_sd: float = 0.0  # robust sd of the noise's AR(1) innovations (x_t - phi x_(t-1)); measured only with impulse_clip > 0
    own_sd: tuple[float, ...] = ()  # per trailing window: null_sd's part that is the candidate's own noise (full)


class ZeroRate(NamedTuple):
    """The two-part comparison's second part: how often the references are exactly 0."""

    rate: np.ndarray  # per reference step: the references' local fraction of exact zeros (a centred mean)
    phi: float  # lag-1 autocorrelation of the 0/1 indicator around it
    null_sd: tuple[float, ...]  # per trailing window: sd of (candidate's zero fraction - rate) under no change
    threshold: tuple[float, ...]  # per trailing window, in null sd (>= k; self-calibrated as the level bars)
    run_bar: int = 0  # steps in a row exactly 0 that are a departure wherever the rate is (RUN_FACTOR x the references' longest)
    spread: float = 0.0  # sd of the seed-to-seed difference of the rate
    points: int = 0  # the references' most points (how many chances a run had there)


def ar_diff_var(q: int, p: int, phi: float) -> float:
    """Variance of (mean of the last `q` points - mean of the `p` before them), unit-variance AR(1)."""
    idx = np.arange(q + p)
    cov = phi ** np.abs(idx[:, None] - idx[None, :]) if phi > 0 else np.eye(q + p)
    w = np.r_[-np.ones(p) / p, np.ones(q) / q]
    return float(w @ cov @ w)


def thin_mean_var(m: int, phi: float, fill: float = 1.0) -> float:
    """`ar_mean_var` where each of the `m` steps holds a point with probability `fill` (the two-part
    comparison's zeros are left out): fewer points, as correlated as their steps. Averaged over which
    steps hold one, (1/(f m)^2) (f m + f^2 (m^2 ar_mean_var - m)) = ar_mean_var + (1 - f) / (f m)."""
    return ar_mean_var(m, phi) + (1 - fill) / (fill * m)


def thinned_phi(phi: float, fill: float) -> float:
    """Lag-1 autocorrelation of AR(1) points once each step holds one with probability `fill` (the
    two-part comparison's zeros left out), counted in points: E[phi^gap] over geometric gaps. Points d
    apart correlate as its d-th power, so the kept points are AR(1) with it."""
    return fill * phi / (1 - (1 - fill) * phi) if fill < 1 else phi


def clean_impulses(r: np.ndarray, phi: float, innov_sd: float, clip: float) -> np.ndarray:
    """The residual `r` with the echo of each impulse taken out: AR(1) innovations (r_t - phi r_(t-1))
    beyond `clip` innovation sd are cut back to it, and what was cut is removed from the steps after as
    the noise would carry it (phi^k after k steps). So one huge heavy-tailed innovation is one point, as
    an isolated spike is, and not a 10-20-step geometric excursion that the trailing medians read as a
    shift: 3 of the 4 no-change 100k-step candidates flagged (phi 0.75, t(3)/t(5)) were such echoes of
    a 30-70 sd innovation. A lasting shift is kept: its first innovation may be cut, but each later one
    carries (1 - phi) of it, which rebuilds the level at the noise's own pace (a 5-sd shift at phi 0.85
    loses ~0.8 sd of it 5 steps on). Causal (each step uses the ones before), so a prefix of a run is
    cleaned as the whole run is; a point with no finite one before it is judged alone (below).
    `DivergenceConfig.impulse_clip`, off by default: what each setting costs is in README. At 10, with the
    references' centre cleaned too, bench.divergence_length's tuning seeds go from 41 to 25 false alarms of
    368 and 30 to 15 early alerts of 460; bench.divergence_quality's held-out seeds 40-119 lose one 3-sd
    shift (5 -> 6 missed of 80), false and early alarms as they were (6, 7)."""
    if not (clip > 0 and innov_sd > 0 and phi > 0) or len(r) < 2:
        return r
    from scipy.signal import lfilter

    # a point with no finite one before it (the run's first, the first after a gap) is judged on its own,
    # its deviation in the stationary sd (innov_sd / sqrt(1 - phi^2)): a spike there is cut to a point,
    # not left in to make the next innovation (-phi times it) read as a shock the other way
    ar = np.sqrt(1.0 - min(phi, 0.99) ** 2)
    u = np.empty(len(r))
    u[0] = r[0] * ar
    with quiet():
        u[1:] = np.where(np.isfinite(r[:-1]), r[1:] - phi * r[:-1], r[1:] * ar)
    lim = clip * innov_sd
    excess = np.where(np.isfinite(u), u - np.clip(u, -lim, lim), 0.0)
    alone = np.r_[True, ~np.isfinite(r[:-1])]
    excess[alone] /= ar  # back in the residual's units
    if not excess.any():
        return r
    return r - lfilter([1.0], [1.0, -phi], excess)


def points(x: np.ndarray, compress: bool) -> np.ndarray:
    """`x`'s finite points alone where `compress` (the two-part comparison: windows count points, so a
    burst of fewer than half a window's points cannot move its median, whatever the zeros around it)."""
    return x[np.isfinite(x)] if compress else x


def _skew(x: np.ndarray) -> float:
    x = x[np.isfinite(x)]
    if len(x) < 8:
        return 0.0
    q10, q50, q90 = np.quantile(x, [0.1, 0.5, 0.9])
    return float((q90 + q10 - 2 * q50) / (q90 - q10)) if q90 > q10 else 0.0


# A positive metric may be exactly 0 at up to this fraction of its points and still be compared as logs:
# KL new/old and the clip rate are 0 on an on-policy first step (a zero becomes far below, one point
# that the medians pass over). One such zero used to keep the metric on its right-skewed linear scale.
MAX_ZEROS = 0.1
# Beyond it, the two-part comparison, where the references hold this many values other than 0 (else the
# linear scale, as before: a metric that is nearly always 0 has too few to model).
MIN_TWO_PART_VALUES = 30


def two_part(raw: np.ndarray) -> tuple[bool, float]:
    """Whether the references (steps x seeds, NaN where missing) are compared in two parts (exactly 0 at
    more than MAX_ZEROS of their points, MIN_TWO_PART_VALUES other values or more), and the fraction of
    their finite points that are not 0. A signed metric too: a GRPO loss is exactly 0 at the steps where
    every group's rewards are equal (no advantage), and a rise of those from 30% to 70% of steps went
    unseen on its linear scale (0 of 40, one to three references)."""
    ok = raw[np.isfinite(raw)]
    if not len(ok):
        return False, 1.0
    nonzero = ok != 0
    return bool(nonzero.mean() < 1 - MAX_ZEROS and nonzero.sum() >= MIN_TWO_PART_VALUES), float(nonzero.mean())


def _use_log(refs: np.ndarray, detrend: int) -> tuple[bool, np.ndarray | None]:
    """Positive metrics whose noise is multiplicative (KL, clip rate, grad norm) are compared as logs;
    also the references' wide smooth where it was computed (the noise model reuses it).

    Where the references' level moves 2x or more, how the noise's scale follows it decides (logs if
    it grows with the level); elsewhere, whichever scale leaves the residuals less skewed. The skew
    alone confused a curve's bend with its noise: an entropy-like decaying curve with additive noise
    went to logs, where the noise grows as the curve falls, and same-distribution candidates were
    flagged (tests/app/analysis/test_divergence_rl.py)."""
    ok = refs[np.isfinite(refs)]
    pos = ok > 0
    if pos.sum() < 8 or ok.min() < 0 or pos.mean() < 1 - MAX_ZEROS:
        return False, None
    wide = rolling(refs, detrend, "median", center=True)
    slope = _scale_slope(refs, wide, detrend)
    if slope is not None:
        return slope > 0.5, wide
    with quiet():
        lg = np.log(np.where(refs > 0, refs, np.nan))
    lgr = lg - rolling(lg, detrend, "median", center=True)
    return abs(_skew(lgr.ravel())) + 0.05 < abs(_skew((refs - wide).ravel())), wide


def _scale_slope(refs: np.ndarray, wide: np.ndarray, detrend: int) -> float | None:
    """The slope of log(the noise's local scale) on log(the level), over the references' points (every
    8th: neighbours are alike): about 1 for multiplicative noise, 0 for additive; None where the level
    moves less than 2x (10th to 90th percentile), too little to tell."""
    with quiet():
        x = np.log(wide).ravel()[::8]
    fin = np.isfinite(x)
    if fin.sum() < 8:
        return None
    lo, hi = np.quantile(x[fin], [0.1, 0.9])
    if hi - lo < np.log(2):
        return None
    with quiet():
        y = np.log(rolling(np.abs(refs - wide), detrend, "median", center=True)).ravel()[::8]
    ok = fin & np.isfinite(y)
    return float(np.polyfit(x[ok], y[ok], 1)[0]) if ok.sum() >= 8 else None


# A metric on a lattice (a count, a rate of k in N tokens, a reward of k/8) that is mostly one value: a
# window's median is a lattice value that jumps a whole quantum when a few more points sit on the next one,
# and the noise's MAD is 0. Such values get a jitter of up to half a quantum, the same at each step for
# every run (a function of the step, so a prefix of a run is jittered as the whole run is), which makes
# the medians continuous (the jittering of counts of Machado and Santos Silva, 2005). Reported sizes are
# of the values logged.
MAX_LATTICE_VALUES = 64  # more distinct values than this: not treated as quantised


def quantum(values: np.ndarray) -> float:
    """The lattice step of the references' finite values, 0 where there is none: at most
    MAX_LATTICE_VALUES distinct values, each repeated 4 times or more on average, all whole multiples
    of the smallest gap from the lowest."""
    v = values[np.isfinite(values)]
    u = np.unique(v)
    if len(u) < 2 or len(u) > MAX_LATTICE_VALUES or len(v) < 4 * len(u):
        return 0.0
    q = float(np.min(np.diff(u)))
    k = (u - u[0]) / q
    return q if q > 0 and bool(np.all(np.abs(k - np.round(k)) < 1e-6 * max(1.0, float(k[-1])))) else 0.0


def dequantise(values: np.ndarray, steps: np.ndarray, q: float, keep_zeros: bool) -> np.ndarray:
    """`values` (per step, or steps x seeds) plus a jitter in [-q/2, q/2) that is a function of the
    step (a Weyl sequence: the jitters of neighbouring steps are spread evenly); NaN stays NaN.
    `keep_zeros` (logs, or the two-part comparison): exact zeros stay 0 and positive values positive."""
    if not q > 0:
        return values
    u = np.mod(np.asarray(steps, float) * 0.6180339887498949 + 0.5, 1.0) - 0.5
    out = values + q * (u if np.ndim(values) == 1 else u[:, None])
    if keep_zeros:
        out = np.where((values == 0) | ((values > 0) & (out <= 0)), values, out)
    return out


def transform(values: np.ndarray, log: bool, floor: float, zeros_out: bool = False) -> np.ndarray:
    """The compared scale; a value <= 0 where the references are positive becomes far below them, a
    missing one (NaN) stays missing (not compared; NaN > 0 is False, so it would become the floor).
    `zeros_out` (the two-part comparison): exact zeros are left out (NaN), compared by `ZeroRate`."""
    if zeros_out:
        values = np.where(values == 0, np.nan, values)
    if not log:
        return values
    with quiet():
        return np.where(np.isnan(values), np.nan, np.log(np.where(values > 0, values, floor)))


@dataclass(frozen=True)
class RefModel:
    """The references on their own step grid: smoothed centre, noise model (cached per references+config)."""

    steps: np.ndarray
    values: np.ndarray  # (steps x seeds), compared scale, NaN where missing or non-finite (or a left-out zero)
    center: np.ndarray  # compared scale
    log_floor: float
    noise: NoiseModel
    ref_ok: np.ndarray  # per step: some reference logged a finite value there (the steps compared)
    zeros: ZeroRate | None = None  # the two-part comparison's zero rate; None: one part
    quantum: float = 0.0  # lattice step of the compared values, which are jittered by up to half of it (`dequantise`); 0: none


# A trailing window reports once half of it is filled (at a run's start, and for the shortest window in
# a short run): 6 points of 11, a majority, so 5 outliers in a row cannot make its median. 0.6 (7 of 11)
# found departures from step 0 a step later (median 6 steps, 5 now) with no false or early alarm fewer on
# bench.divergence_quality's seeds, held-out seeds or 100k-step runs.
MIN_FILL = 0.5


def min_points(m: int) -> int:
    """Points a trailing window of `m` needs before it reports."""
    return max(1, int(np.ceil(MIN_FILL * m - 1e-9)))


def _trailing_median(x: np.ndarray, m: int) -> np.ndarray:
    """Median of the last `m` finite points up to each index (NaN until `min_points(m)` are there); where
    the window holds an even count, the middle point nearer 0 (`_even_toward_zero`)."""
    med = rolling(x, m, "median", center=False, min_periods=min_points(m))
    return _even_toward_zero(x, m, med)


def _even_toward_zero(x: np.ndarray, m: int, med: np.ndarray) -> np.ndarray:
    """Trailing medians of a residual `x` where their window holds an even count of points: the one of the
    two middle points nearer 0 (0 where they straddle it), not their mean. A burst of half a window's
    points makes one middle point: a window half full at a run's start (6 points of 11) holding a 3-step
    warm-up burst of 4-8 sd had its mean of the middle points at 3-4 sd of noise, 6-8 sd of the median's
    (bench.divergence_length `warmup`, tuning seeds 90 and 197 at 1k steps, 21 at 10k: 2-4 references, at
    most one with a burst of its own; flagged at step 5); the nearer point is a clean one. A real shift
    moves both middle points, so it still shows (`bench.divergence_quality`'s shifts from step 0: same
    times to alert). Cost: a sort of each such window's points (a run's first steps; every other step of
    a run with gaps), no slower on 100k-step runs."""
    c = np.cumsum(np.isfinite(x))
    c[m:] -= c[:-m].copy()
    idx = np.flatnonzero((c % 2 == 0) & np.isfinite(med))
    if not idx.size:
        return med
    pad = np.r_[np.full(m - 1, np.nan), x]
    out = med.copy()
    for lo in range(0, idx.size, max(1, 2_000_000 // m)):  # bounded memory where a gappy run has many
        rows = idx[lo:lo + 2_000_000 // m]
        win = np.sort(np.lib.stride_tricks.sliding_window_view(pad, m)[rows], axis=1)  # NaN last
        k = c[rows]
        r = np.arange(len(rows))
        lower, upper = win[r, k // 2 - 1], win[r, k // 2]
        out[rows] = np.where(lower > 0, lower, np.where(upper < 0, upper, 0.0))
    return out


def paired(own: list[np.ndarray], centre: np.ndarray) -> list[np.ndarray]:
    """Each reference's own residual less the centre's (`centre`, around the same wide smooth) half a run
    away: what a candidate's residual holds, its own noise and the centre's at an unrelated time."""
    return [x - np.roll(centre, len(centre) // 2) for x in own]


def partial_sd(x: np.ndarray, m: int, phi: float, full_sd: float, own_sd: float) -> np.ndarray | float:
    """Per index, the no-change sd of the trailing m-median of `x` given how many finite points its
    window holds: `full_sd` with its own-noise part (`own_sd`, a full window's) grown to a window of c
    points' (ar_mean_var(c) for ar_mean_var(m)). A window of 6 points at a run's start (or after a gap)
    was tested with the sd of 11: its median's sd is 1.2-1.4x that, so a normal 3-step burst in a run's
    first steps (a gradient norm's warm-up) read as 6-8 sd (bench.divergence_length, `warmup`: 7 of 60
    no-change 1k-step candidates flagged at step 5)."""
    if not own_sd > 0:
        return full_sd
    c = np.cumsum(np.isfinite(x))
    c[m:] -= c[:-m].copy()  # finite points in each trailing window of m
    full_var = ar_mean_var(m, phi)
    table = np.array([ar_mean_var(max(k, 1), phi) / full_var - 1.0 for k in range(m + 1)])
    return np.sqrt(full_sd**2 + own_sd**2 * table[c])


@functools.lru_cache(maxsize=32)
def reference_model(references: tuple[Trace, ...], config) -> RefModel:
    steps = np.unique(np.concatenate([t.steps for t in references])) if references else np.empty(0, np.int64)
    raw = np.full((len(steps), len(references)), np.nan)
    ref_nonfinite = False
    for j, t in enumerate(references):
        pos = np.searchsorted(steps, t.steps)
        v = finite_values(t.values)
        ref_nonfinite |= bool(np.isnan(v).any() and len(v))
        raw[pos, j] = v
    with quiet():
        split, fill = two_part(raw)
        fill = fill if split else 1.0
        level_raw = np.where(raw == 0, np.nan, raw) if split else raw
        q = quantum(level_raw)
        log, raw_wide = _use_log(dequantise(level_raw, steps, q, keep_zeros=True), config.detrend_window)
        if q > 0 and not log and not split:  # on the linear scale zeros are jittered too: the wide smooth again
            raw_wide = None
        pos_min = np.nanmin(np.where(raw > 0, raw, np.nan)) if log else 1.0
        log_floor = float(pos_min) / 10 if log else 1.0
        vals = transform(dequantise(level_raw, steps, q, keep_zeros=log or split), log, log_floor, zeros_out=split)
        # a centre point needs half the window's points (half of those it holds, where zeros are left out)
        need = max(1, int(np.ceil((config.window // 2 + 1) * fill)))
        smooth = rolling(vals, config.window, "median", center=True, min_periods=need)
        center = row_nanmedian(smooth)
        if split:  # between points other than 0 the centre is their interpolation (steps where all are 0)
            center = _interpolate(center)
        # Point noise and its autocorrelation from each seed's residual around a wide smooth (trend out):
        # structure function D(h) = robust variance of x[t+h] - x[t]; AR(1): D(2)/D(1) = 1 + phi.
        wide = (raw_wide if raw_wide is not None and not log
                else rolling(vals, config.detrend_window, "median", center=True, min_periods=1))
        resid = vals - wide
        # sigma: robust sd of the residual; phi from the lag-1 structure function D(1) = 2 sigma^2 (1 - phi)
        # (steadier than a ratio of two structure-function values).
        s2 = np.nanmedian([_mad(resid[:, j]) ** 2 for j in range(vals.shape[1])])
        d1 = np.nanmedian([_mad(np.diff(resid[:, j])) ** 2 for j in range(vals.shape[1])])
        if not np.isfinite(s2) or s2 <= 0:  # quantised metrics: MAD 0; mean absolute deviation then
            dev = np.abs(resid)
            s2 = float(np.nanmean(dev) * 1.2533) ** 2 if np.isfinite(dev).any() else 0.0
            diffs = np.abs(np.diff(resid, axis=0))
            d1 = float(np.nanmean(diffs) * 1.2533) ** 2 if np.isfinite(diffs).any() else 0.0
        phi = float(np.clip(1 - d1 / (2 * s2), 0.0, 0.95)) if s2 > 0 and np.isfinite(d1) else 0.0
        sigma = float(np.sqrt(s2)) if s2 > 0 else 0.0
        n = vals.shape[1]
        # Seed-to-seed spread: each seed's wide smooth around the seeds' median, noise of that smooth out.
        if n >= 2:
            wide_c = row_nanmedian(wide)
            dev = wide - wide_c[:, None]
            est = float(np.nanmean(dev**2) * n / (n - 1)) if np.isfinite(dev).any() else 0.0
            est = max(est - sigma**2 * thin_mean_var(config.detrend_window, phi, fill), 0.0)
        else:
            est = 0.0
        prior, k0 = (config.seed_spread * sigma) ** 2, config.seed_spread_weight
        spread = float(np.sqrt(((n - 1) * est + k0 * prior) / (n - 1 + k0)))
        scale_of_level = float(np.nanmedian(np.abs(center))) if np.isfinite(center).any() else 1.0
        # windows count points: where zeros are left out, a window's points are thinned steps
        phi_w = thinned_phi(phi, fill)
        # no test's sd is below the metric's rounding: float32 rounds a value relative to its own size, so a
        # metric of one sign that is never 0 (a learning rate of 1e-7, a parity mismatch of 1e-8) is rounded at
        # its level; one that is 0 or changes sign may be a sum that cancels (a GRPO loss), rounded at its terms'
        # scale, of order 1 (RESOLUTION). A floor of 3e-7 hid a 1e-7 -> 2e-7 learning rate and a 3x rise of a
        # metric at 1e-12 ("within the band (a lasting shift under 2.98e-07 would not show)").
        fin = raw[np.isfinite(raw)]
        one_signed = not log and fin.size > 0 and bool((fin > 0).all() or (fin < 0).all())
        rounding = RESOLUTION * (scale_of_level if one_signed else max(1.0, scale_of_level))
        # the innovations' robust sd, each seed's points as the level windows see them; the references'
        # residuals are cleaned of impulses as a candidate's are, so the bars they set are for the same statistic
        innov = [_mad(x[1:] - phi_w * x[:-1]) for x in (points(resid[:, j], split) for j in range(n))
                 if len(x) > 2] if config.impulse_clip > 0 else []
        innov_sd = float(np.nanmedian(innov)) if np.isfinite(innov).any() else 0.0

        def clean(x: np.ndarray) -> np.ndarray:
            return clean_impulses(x, phi_w, innov_sd, config.impulse_clip)

        if innov_sd > 0 and not split:
            # the centre from references cleaned of impulse echoes too: one reference's 14-sd innovation at
            # phi 0.75-0.85 moved its 9-step centre for ~10 steps, and a candidate read as departing the
            # other way (4 of 41 no-change flags on bench.divergence_length were such)
            vals_c = np.column_stack([wide[:, j] + clean(resid[:, j]) for j in range(n)])
            smooth = rolling(vals_c, config.window, "median", center=True, min_periods=need)
            center = row_nanmedian(smooth)

        def null_sd_of(m: int, seeds: int) -> float:
            """sd of (a seed's trailing m-median - the centre of `seeds` seeds) under no change: its own noise,
            the centre's error (a w-step smooth averaged over m >= w steps errs as the raw points' m-step
            average does) and the seed-to-seed spread."""
            center_var = median_var(phi_w) * sigma**2 * ar_mean_var(max(m, config.window), phi_w) / max(seeds, 1)
            v = median_var(phi_w) * sigma**2 * ar_mean_var(m, phi_w) + center_var + spread**2 * (1 + 1 / max(seeds, 1))
            return max(float(np.sqrt(v)), config.min_delta / config.k, rounding)

        # The candidate against its own recent past (relative to the centre): seed offsets and wander
        # cancel, so an abrupt change shows long before its level clears the seed spread.
        change_sd = tuple(max(float(np.sqrt(median_var(phi_w) * sigma**2 * ar_diff_var(q, p, phi_w))),
                              rounding) for q, p in config.change_windows)

        def own_of(m: int) -> float:  # a full window's own-noise part of the null sd
            return float(np.sqrt(median_var(phi_w) * sigma**2 * ar_mean_var(m, phi_w)))

        loo_level, loo_change = _leave_one_out(vals, smooth, config, null_sd_of, change_sd, split, clean,
                                               lambda x, m, sd: partial_sd(x, m, phi_w, sd, own_of(m)))
        own_pts = [clean(points(resid[:, j], split)) for j in range(n)]
        counts = [int(np.isfinite(x).sum()) for x in own_pts]
        cal = Calibration(config.alpha, max(counts, default=1), sum(counts), phi_w) if config.alpha > 0 else None
        own_med: list[dict[int, np.ndarray]] = [{} for _ in own_pts]

        def own_trailing(j: int, m: int) -> np.ndarray:  # shared by the level bars and the change bars
            if m not in own_med[j]:
                own_med[j][m] = _trailing_median(own_pts[j], m)
            return own_med[j][m]

        # A candidate's residual holds the centre's noise beside its own (`paired`): with one reference (2+: the
        # leave-one-out scores hold it); not in the two-part comparison, whose centre is interpolated between points
        pair_pts = None if split or cal is None or n > 1 else paired(own_pts, center - row_nanmedian(wide))
        pair_med: list[dict[int, np.ndarray]] = [{} for _ in own_pts]

        def pair_trailing(j: int, m: int) -> np.ndarray:
            if m not in pair_med[j]:
                pair_med[j][m] = _trailing_median(pair_pts[j], m)
            return pair_med[j][m]

        null_sd, thresholds, owns = [], [], []
        for wi, m in enumerate(config.windows):
            sd = null_sd_of(m, n)
            null_sd.append(sd)
            # Self-calibration: the largest |trailing median| each seed's own residual reaches on this window
            # (bursts, heavy tails) sets the bar for a candidate of the same configuration.
            own_sd = own_of(m)
            owns.append(own_sd)
            top = 0.0
            if own_sd > 0:
                for j, x in enumerate(own_pts):
                    tm = own_trailing(j, m)
                    if np.isfinite(tm).any():
                        top = max(top, float(np.nanmax(np.abs(tm) / partial_sd(x, m, phi_w, own_sd, own_sd))))
            # Short windows are tested many more times a run than long ones (and feel heavy tails more):
            # their bar rises by `k_per_halving` for each halving below the longest window.
            pair_top = 0.0  # in the null sd; windows as long as the wide smooth: `paired`
            if pair_pts is not None and sd > 0 and m < config.detrend_window:
                for j, x in enumerate(pair_pts):
                    if np.isfinite(tm := pair_trailing(j, m)).any():
                        pair_top = max(pair_top, float(np.nanmax(np.abs(tm) / partial_sd(x, m, phi_w, sd, own_sd))))
            thresholds.append(window_bar(config, m, top, own_sd / sd if sd > 0 else 0.0, loo_level[wi], cal,
                                         pair_top))
        # The floors: one reference, k_change; with 2+, a lower floor, since each change test's bar rises to what
        # the references reach left out in turn (with alpha > 0 both also rise to what their own residuals
        # reach, carried to alpha, and to the model's bar, x sqrt(1 + 1/n) for the centre's own change). bench.divergence_rl, floor 7.5 -> 6.5: level3
        # median time to alert 17.5 -> 11 and 2 -> 1 misses (seeds 0-39), no false alarm more on held-out seeds
        # 40-119 or on 100k-step runs; 6.0 flagged one more 100k-step run, and 6.0 for a single reference too
        # gave 19 held-out false alarms instead of 8.
        k_floor = config.k_change if n < 2 else config.k_change_loo
        if cal is None:
            change_bar = tuple(max(k_floor, config.calibration_margin * c) for c in loo_change)
        else:  # the candidate's change also holds the centre's (about 1/n of its own variance)
            own_change = _own_change_tops(own_trailing, n, config, change_sd)
            pair_change = (_own_change_tops(pair_trailing, n, config, change_sd) if pair_pts is not None
                           else [0.0] * len(own_change))
            change_bar = tuple(max(k_floor, cal.model(q) * np.sqrt(1 + 1 / n), cal.extrapolate(q, max(own, pair)),
                                   cal.extrapolate(q, loo))
                               for (q, _), own, pair, loo in zip(config.change_windows, own_change, pair_change,
                                                                 loo_change))
        diff_scale, var_bar = _variance_bar(vals, sigma, phi, config, compress=split)
        diff_scale = max(diff_scale, rounding)
        zeros = _zero_rate(raw, config) if split else None
    noise = NoiseModel(log, sigma, phi, spread, n, tuple(null_sd), change_sd, tuple(thresholds), ref_nonfinite,
                       diff_scale, var_bar, change_bar, fill, innov_sd, tuple(owns))
    ref_ok = np.isfinite(raw).any(axis=1) if raw.shape[1] else np.zeros(len(steps), bool)
    return RefModel(steps, vals, center, log_floor, noise, ref_ok, zeros, q)


def window_bar(config, m: int, own_top: float, own_share: float, loo: float, cal: Calibration | None = None,
               pair_top: float = 0.0) -> float:
    """A trailing window's bar, in its null sd, from what the references reach on it: `own_top`, the largest
    |trailing median| of their own residuals in sd of their own noise (`own_share` of the null sd: in the
    null sd, own_top x own_share is the size of their largest excursion, which a candidate's own noise
    makes too), `pair_top`, the same of their own residuals less the centre's (`paired`, in the null sd), and
    `loo`, each left out against the others (in the null sd). With `cal` (alpha > 0): `Calibration.bar` of
    them. Else (alpha = 0, the fixed bars before issue 43) `k`, raised by
    `k_per_halving` for each halving below the longest window, or `calibration_margin` x those, whichever
    is more."""
    k_m = config.k + config.k_per_halving * np.log2(config.windows[-1] / m)
    if cal is not None:
        return max(k_m, cal.bar(m, own_top * own_share, pair_top, loo))
    return max(k_m, config.calibration_margin * own_top * own_share, config.calibration_margin * loo)


def _interpolate(x: np.ndarray) -> np.ndarray:
    """NaN between finite values filled by linear interpolation over the index (the ends stay NaN)."""
    ok = np.flatnonzero(np.isfinite(x))
    if len(ok) < 2:
        return x
    out = x.copy()
    inner = np.arange(ok[0], ok[-1] + 1)
    out[inner] = np.interp(inner, ok, x[ok])
    return out


def trailing_mean(x: np.ndarray, m: int) -> np.ndarray:
    """Mean of the finite points among the last `m` up to each index (NaN until `min_points(m)`)."""
    return rolling(x, m, "mean", center=False, min_periods=min_points(m))


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


def _leave_one_out(vals: np.ndarray, smooth: np.ndarray, config, null_sd_of, change_sd: tuple[float, ...],
                   compress: bool = False, clean=lambda x: x,
                   partial=lambda x, m, sd: sd) -> tuple[list[float], list[float]]:
    """With 2 or more seeds, each seed is a no-change candidate against the centre of the others: the
    largest |z| each level window and each change test reaches on it, over the whole run (z in the null
    sd of a centre of n-1 seeds). It carries what the noise model leaves out (how far seeds wander apart
    over a long run, tails, bursts), and grows with the run's length as a candidate's own largest value
    does: at 100k steps the model's bars alone flagged 7 of 24 no-change candidates (bench.divergence_rl's
    noise, phi 0.6-0.85). Zeros with one seed (nothing to leave out)."""
    n = vals.shape[1]
    level = [0.0] * len(config.windows)
    change = [0.0] * len(config.change_windows)
    if n < 2:
        return level, change
    for j in range(n):
        r = clean(points(vals[:, j] - row_nanmedian(np.delete(smooth, j, axis=1)), compress))
        lengths = {*config.windows, *(w for pair in config.change_windows for w in pair)}
        med = {m: _trailing_median(r, m) for m in lengths}
        for wi, m in enumerate(config.windows):
            z = med[m] / partial(r, m, null_sd_of(m, n - 1))
            if np.isfinite(z).any():
                level[wi] = max(level[wi], float(np.nanmax(np.abs(z))))
        for ci, ((q, p), sd) in enumerate(zip(config.change_windows, change_sd)):
            before = np.roll(med[p], q)
            before[:q] = np.nan
            zc = (med[q] - before) / sd
            if np.isfinite(zc).any():
                change[ci] = max(change[ci], float(np.nanmax(np.abs(zc))))
    return level, change


def _own_change_tops(trailing, seeds: int, config, change_sd: tuple[float, ...]) -> list[float]:
    """The largest |change| (recent median - the one before, in `change_sd`) each change test reaches on
    the references' own residuals (`trailing(j, m)`: seed j's trailing m-medians): what their tails do to
    it, with one reference too."""
    out = [0.0] * len(config.change_windows)
    for j in range(seeds):
        for ci, ((q, p), sd) in enumerate(zip(config.change_windows, change_sd)):
            if not sd > 0:
                continue
            before = np.roll(trailing(j, p), q)
            before[:q] = np.nan
            with quiet():
                zc = (trailing(j, q) - before) / sd
            if np.isfinite(zc).any():
                out[ci] = max(out[ci], float(np.nanmax(np.abs(zc))))
    return out


def _variance_bar(vals: np.ndarray, sigma: float, phi: float, config, compress: bool = False) -> tuple[float, float]:
    """The references' robust scale of step-to-step changes, measured as the candidate's is, and the
    variance bar over it: `var_ratio`, raised to `calibration_margin` x the largest ratio any reference's
    own trailing scale reaches over its run (a longer or burstier reference raises it).

    Measured directly rather than as `sigma * sqrt(2 (1 - phi))`: under heavy tails (t(3) noise) the two
    differ by 10-20%, which put same-distribution candidates over the bar (8 of 14 false alarms on
    bench.divergence_rl's held-out seeds 40-119 were variance ones). `compress` (the two-part comparison):
    changes between consecutive points, the left-out zeros skipped, as `candidate_scale(carry=...)`."""
    cols = [points(vals[:, j], compress) for j in range(vals.shape[1])]
    per_seed = []
    for x in cols:
        d = np.abs(np.diff(x))
        d = d[np.isfinite(d)]
        if len(d):
            s = _MAD * float(np.median(d))
            per_seed.append(s if s > 0 else 1.2533 * float(np.mean(d)))  # quantised: mean absolute change
    scale = float(np.median(per_seed)) if per_seed else 0.0
    if not scale > 0:
        return sigma * np.sqrt(2 * (1 - phi)), config.var_ratio
    top = 0.0
    for x in cols:
        own = candidate_scale(x, config.var_window)
        if np.isfinite(own).any():
            top = max(top, float(np.nanmax(own)) / scale)
    return scale, max(config.var_ratio, config.calibration_margin * top)


def spacing(pos: np.ndarray) -> int:
    """The candidate's typical gap between compared points, in the references' logged steps (1: it logs
    where they do; 5: a candidate with `logging_steps=5` against references that log every step)."""
    return max(1, round(float(np.median(np.diff(pos))))) if len(pos) > 2 else 1


def scan(r: np.ndarray, cand_bad: np.ndarray, cand_resid_scale: np.ndarray, noise: NoiseModel,
         config, cand_abs_diff: np.ndarray | None = None, zero_ind: np.ndarray | None = None,
         zeros: ZeroRate | None = None, zero_rate: np.ndarray | None = None) -> list[Stretch]:
    """Every departure of the residual `r` (candidate - centre, compared scale) in order of time.

    `cand_bad`: candidate non-finite where a reference is finite; `cand_resid_scale`: trailing robust
    scale of the candidate's first differences (for variance departures); `zero_ind` (two-part
    comparison, with `zeros`): the candidate's 0/1 exact-zero indicator, `zero_rate` the references'
    rate at its steps."""
    n = len(r)
    full_r = r
    keep = np.flatnonzero(np.isfinite(r)) if noise.fill < 1 else None  # level windows count points
    r = level_residual(r, noise, config)
    medians: dict[int, np.ndarray] = {}

    def trailing(m: int) -> np.ndarray:  # the change test reuses the level windows' medians
        if m not in medians:
            medians[m] = _trailing_median(r, m)
        return medians[m]

    with quiet():
        # a window partly filled (a run's start, after a gap) has the sd of the points it holds
        level = {m: trailing(m) / partial_sd(r, m, thinned_phi(noise.phi, noise.fill), sd, own)
                 for m, sd, own in zip(config.windows, noise.null_sd, noise.own_sd or (0.0,) * len(noise.null_sd))}
        # (window, z, bar, window whose level z says when it is over, steps it looks back, its null sd)
        # every window at every step where it is 60% full: whether a window counts never depends on
        # how long the candidate is now, so a prefix of the run reports what the whole run reports there
        tests = [(m, level[m], th, m, m, sd) for m, th, sd in zip(config.windows, noise.threshold, noise.null_sd)]
        for (q, p), sd, change_bar in zip(config.change_windows, noise.change_sd, noise.change_bar):
            before = np.roll(trailing(p), q)
            before[:q] = np.nan
            zc = (trailing(q) - before) / sd
            end_m = q if q in level else config.windows[0]
            # a change counts only away from the centre and while the recent level is not back inside
            # (the end rule's half bar): a return from a departure is a change too, not a departure
            lvl = level[end_m]
            bar = noise.threshold[list(config.windows).index(end_m)]
            zc = np.where((np.sign(zc) == np.sign(lvl)) & (np.abs(lvl) >= bar / 2), zc, 0.0)
            tests.append((q, zc, change_bar, end_m, q + p, sd))
    edge = min(th * sd for th, sd in zip(noise.threshold, noise.null_sd))  # `first_out`'s band
    out = _stretches(r, tests, level, noise.threshold, config.windows, config.window, "level", edge)
    in_points, n_points = out, len(r)  # the stretches as the level windows index them

    def excess(i: int) -> float:
        """Level stretch i's largest |level| over it in its window's bar (the most of any window)."""
        d = in_points[i]
        span = slice(d.onset, n_points if d.end is None else d.end + 1)
        with quiet():
            return max((float(np.nanmax(np.abs(level[m][span]), initial=0.0)) / th
                        for m, th in zip(config.windows, noise.threshold) if th > 0), default=0.0)

    if keep is not None:  # back to the compared steps
        out = [Stretch(d.kind, int(keep[d.onset]), int(keep[d.alert]), None if d.end is None else int(keep[d.end]),
                       d.sign, d.window, None if d.shown is None else int(keep[d.shown])) for d in out]
    r = full_r
    # Variance: the candidate's own step-to-step noise `var_bar` times the references'. A noisier
    # candidate also moves its medians: level stretches inside a variance stretch are that, not a shift,
    # unless one outlasts it or is beyond its bar by more than the noise grew (a candidate at twice the
    # references, noise and all, was a variance departure that ended at step 49 and no level shift).
    ref_scale = noise.diff_scale
    if cand_abs_diff is None:
        cand_abs_diff = np.zeros(n)
    if ref_scale > 0:
        noisy = cand_resid_scale > noise.var_bar * ref_scale
        # var_persist steps in a row (1: the first such step): a longer run trades delay for fewer alarms
        p = config.var_persist
        cn = np.concatenate([[0], np.cumsum(noisy)])
        hits = np.flatnonzero((cn[p:] - cn[:-p]) == p) + p - 1 if n >= p else np.empty(0, int)
        if len(hits):
            a = int(hits[0])
            ratio = max(noise.var_bar, float(cand_resid_scale[a]) / ref_scale)
            onset = variance_onset(cand_abs_diff, a, ref_scale, ratio, 3 * config.var_window)
            shown = first_out(cand_abs_diff, onset, a, noise.var_bar * ref_scale, VAR_ONSET_GAP)
            # over once it is back under the bar for a whole window (the trailing scale flickers at the edge)
            quiet_run = np.concatenate([[0], np.cumsum(~noisy[a:])])
            w = config.var_window
            back = np.flatnonzero((quiet_run[w:] - quiet_run[:-w]) == w) if n - a >= w else np.empty(0, int)
            end = None if not len(back) else a + int(back[0]) - 1
            last = n if end is None else end + config.var_window

            def noise_made(i: int, d: Stretch) -> bool:  # inside the noisier stretch, ends in it, no bigger than its noise
                inside = onset - config.var_window <= d.onset <= last
                outlasts = end is not None and (d.end is None or d.end > last)
                return inside and not outlasts and excess(i) <= ratio

            out = [d for i, d in enumerate(out) if not noise_made(i, d)]
            out.append(Stretch("variance", onset, a, end, 0, config.var_window, shown))
    if zeros is not None and zero_ind is not None:  # how often it is exactly 0: trailing fractions
        zero_resid = zero_ind - zero_rate
        with quiet():
            zl = {m: trailing_mean(zero_resid, m) / sd for m, sd in zip(config.windows, zeros.null_sd)}
        tests = [(m, zl[m], th, m, m, sd) for m, th, sd in zip(config.windows, zeros.threshold, zeros.null_sd)]
        found = _stretches(zero_resid, tests, zl, zeros.threshold, config.windows, config.window, "zero_rate")
        # runs too long for the references, then the trailing fractions; one departure where they overlap
        runs = _run_stretches(zero_ind, zero_rate, zeros)
        for d in sorted(runs + found, key=lambda d: d.alert):
            last = n - 1 if d.end is None else d.end
            if not any(k.onset <= last and d.onset <= (n - 1 if k.end is None else k.end)
                       for k in out if k.kind == "zero_rate"):
                out.append(d)
    # Non-finite: where the references are finite; one step suffices unless references go non-finite too.
    need = config.nonfinite_persist if noise.ref_nonfinite else 1
    c = np.concatenate([[0], np.cumsum(cand_bad)])
    full = np.flatnonzero((c[need:] - c[:-need]) == need) if n >= need else np.empty(0, int)
    if len(full):
        s = int(full[0])
        back = np.flatnonzero(~cand_bad[s:])
        end = None if not len(back) else s + int(back[0]) - 1
        out.append(Stretch("nonfinite", s, s + need - 1, end, 0, need))
    # a level stretch the end rule closed while the candidate stayed out runs on (`not_back`)
    return not_back(r, sorted(out, key=lambda d: (d.onset, d.alert)))


def level_residual(r: np.ndarray, noise: NoiseModel, config) -> np.ndarray:
    """What the level windows and change tests read: the residual's points (its finite ones alone in the
    two-part comparison), cleaned of impulse echoes (`clean_impulses`)."""
    x = r[np.isfinite(r)] if noise.fill < 1 else r
    return clean_impulses(x, thinned_phi(noise.phi, noise.fill), noise.innov_sd, config.impulse_clip)


def detectable_shift(r: np.ndarray, noise: NoiseModel, config) -> float:
    """The smallest lasting shift (compared scale) that some test of `scan` flags, in either direction,
    given where the candidate sits now: a level window (the longest that fills) flags a shift once it
    crosses the far side of its bar, so one against the candidate's own offset from the centre needs that
    offset more; a change test (one whose two windows fill) needs its bar in its own sd, and the level
    it reports on past half its bar. A candidate 0.9 noise sd above the centre that falls by 3 sd ends
    2.1 sd below it: under the level bar, and for the change test a step the seeds' wander can make."""
    x = level_residual(r, noise, config)
    x = x[np.isfinite(x)]
    n = len(x)
    windows = list(config.windows)

    def offset(m: int) -> float:  # the candidate's latest trailing median off the centre (its last m points)
        return abs(float(np.median(x[-m:]))) if n >= min_points(m) else 0.0

    usable = [i for i, m in enumerate(windows) if min_points(m) <= n] or [0]
    i = usable[-1]
    sizes = [noise.threshold[i] * noise.null_sd[i] + offset(windows[i])]
    for (q, p), sd, bar in zip(config.change_windows, noise.change_sd, noise.change_bar):
        if q + min_points(p) > n or not np.isfinite(bar):
            continue
        end_m = q if q in windows else windows[0]
        e = windows.index(end_m)
        sizes.append(max(bar * sd, noise.threshold[e] / 2 * noise.null_sd[e] + offset(end_m)))
    return float(min(sizes))


def _stretches(r: np.ndarray, tests: list, level: dict[int, np.ndarray], bars: tuple[float, ...],
               windows: tuple[int, ...], lookback: int, kind: str,
               edge: float | None = None) -> list[Stretch]:
    """Departures of the residual `r` by `tests` ((window, z, bar, window whose level z says when it is
    over, steps it looks back, its null sd) each): any test beyond its bar; each stretch ends once the
    reporting window's level is back under half its bar for as many steps as the window is long. Where
    each test is beyond its bar, and where each (window, sign) is back inside for a whole window, is
    found once for the run, then looked up per stretch (a long noisy run has hundreds of stretches).
    `edge`: the band's half-width a point must pass for the onset reported (`first_out`); None: the split."""
    n = len(r)
    out: list[Stretch] = []
    with quiet():
        beyond = [np.flatnonzero(np.abs(np.nan_to_num(zz, nan=0.0)) > th) for _, zz, th, _, _, _ in tests]
    back_inside: dict[tuple[int, int], np.ndarray] = {}

    def first_back(end_m: int, sign: int, bar: float, a: int) -> int | None:
        """First index >= a where the level of window `end_m` is back inside for `end_m` steps."""
        if (end_m, sign) not in back_inside:
            inside = np.nan_to_num(level[end_m] * sign, nan=0.0) < bar / 2
            c = np.concatenate([[0], np.cumsum(inside)])
            back_inside[end_m, sign] = np.flatnonzero((c[end_m:] - c[:-end_m]) == end_m)
        full = back_inside[end_m, sign]
        j = int(np.searchsorted(full, a))
        return int(full[j]) if j < len(full) else None

    i, last_end = 0, None
    while i < n:
        hit = None
        for ti, (_, zz, th, _, span, _) in enumerate(tests):
            # after a departure, a test counts once its window no longer reaches back into it
            start = i if last_end is None else max(i, last_end + span)
            j = int(np.searchsorted(beyond[ti], start))
            if j < len(beyond[ti]) and (hit is None or beyond[ti][j] < hit[0]):
                hit = (int(beyond[ti][j]), ti)
        if hit is None:
            break
        a, ti = hit
        m, zz, _, end_m, _, sd = tests[ti]
        sign = int(np.sign(zz[a]))
        wi = list(windows).index(end_m) if end_m in windows else 0
        size = float(zz[a] * sd)  # the stretch's size in the compared scale
        onset = max(i, cusum_onset(r, a, size, lookback=4 * m + lookback))
        shown = None if edge is None else first_out(r * sign, onset, a, edge, windows[0])
        back = first_back(end_m, sign, bars[wi], a)
        if back is not None:
            end = max(back - 1, a)
            out.append(Stretch(kind, onset, a, end, sign, m, shown))
            i, last_end = end + 1, end
        else:
            out.append(Stretch(kind, onset, a, None, sign, m, shown))
            break
    return out


def candidate_scale(cand: np.ndarray, window: int, carry: np.ndarray | None = None) -> np.ndarray:
    """Trailing robust sd of the candidate's first differences over `window` points (NaN until 2/3 full).

    `carry` (the two-part comparison: where the candidate is exactly 0, left out): the differences are
    between consecutive finite points, and at `carry` steps the scale is the last one before them."""
    if carry is not None:
        return _carried(cand, carry, lambda x: candidate_scale(x, window))
    d = np.abs(np.diff(cand, prepend=np.nan))
    return _MAD * rolling(d, window, "median", center=False, min_periods=max(3, 2 * window // 3))


def abs_diffs(cand: np.ndarray, carry: np.ndarray | None = None) -> np.ndarray:
    """|first differences| (what the variance onset weighs); with `carry`, between consecutive finite points."""
    if carry is not None:
        return _carried(cand, carry, abs_diffs, fill=False)
    return np.abs(np.diff(cand, prepend=np.nan))


def _carried(cand: np.ndarray, carry: np.ndarray, f, fill: bool = True) -> np.ndarray:
    """`f` of the candidate's finite points alone, put back at their steps; at `carry` steps the value of
    the last finite step before (NaN with `fill=False`)."""
    ok = np.isfinite(cand)
    out = np.full(len(cand), np.nan)
    out[ok] = f(cand[ok])
    if fill:
        last = np.maximum.accumulate(np.where(ok, np.arange(len(cand)), -1))
        at = carry & ~ok & (last >= 0)
        out[at] = out[last[at]]
    return out
