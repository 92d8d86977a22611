"""The compared scale of a metric's values: MLflow's non-finite stand-ins, logs or linear, lattice values
dequantised, and whether the references are compared in two parts (`two_part`; the zeros' part:
`rldiag.app.analysis.zero_rate`).

Why (measured on `bench.divergence_rl`, RL-like noise):
- Positive heavy-tailed metrics (KL, clip rate, grad norm) are compared as logs, where their noise is
  symmetric, when the references' values are positive (but for at most `MAX_ZEROS` exact zeros) and
  their noise is multiplicative: its scale grows with the level, where the level moves 2x or more;
  else the log is the less skewed scale (`_use_log`).
- Values on a lattice (counts, k of N tokens, rewards of k/8) are jittered by up to half a quantum, the
  same at each step for every run (`dequantise`): medians of values that are mostly one lattice point
  jump a whole quantum, and flagged a fifth to a half of same-distribution count-like candidates.
"""

from __future__ import annotations

import numpy as np

from rldiag.app.analysis.onsets import quiet
from rldiag.app.analysis.trailing_stats import rolling

MAX_FLOAT = float(np.finfo(np.float64).max)  # MLflow's stand-in for inf


def finite_values(values: np.ndarray) -> np.ndarray:
    """Values with MLflow's max-float stand-ins read as inf and every non-finite value as NaN."""
    v = np.asarray(values, float)
    return np.where(np.isfinite(v) & (np.abs(v) < MAX_FLOAT), v, np.nan)


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
