"""The references' noise model (`reference_model`): their centre on their own step grid, point noise
and its autocorrelation, the seed-to-seed spread, and every test's null sd and bar (cached per
references + config).

Why (measured on `bench.divergence_rl`, RL-like noise):
- RL curves are autocorrelated (AR(1) phi up to ~0.85): a band that treats neighbouring points as
  independent underestimates how far a run of points wanders and fires on one seed in six. The null
  variance of a window's median is computed from the references' own autocorrelation (a structure
  function of their residuals), so persistence means what it says under correlated noise.
- Seeds differ by a slow wander and a level offset: a window's null variance has a floor, the
  seed-to-seed spread, estimated from the references' smoothed curves (shrunk towards a prior of
  `seed_spread` noise sd, which is all a single reference can give).
- One reference cannot show how far another seed sits from it, but a long one shows its own slow wander:
  its level (medians of blocks as long as the longest window) moves around a trend much slower than it
  (`own_wander`). With one reference the spread is the prior (the constant offset, still unmeasured:
  `reference_note`) plus that wander; with 2 or more the between-seed estimate holds it already (shrunk
  towards the prior as before, at least the wander: measured, no change on 2-reference slices).
  bench.divergence_length, tuning seeds, one reference forced (`--refs 1 --lengths 10000,100000 --kinds
  none,jump,warmup,wander`): 20 -> 14 flagged of 128; on 60/24 seeds of none,wander the 2-3 sd departures
  of a window of 41-129 lasting hundreds of steps went from 9 to 2 of 168 (the others are jump echoes on
  11-21 windows). The price (`--kinds level3,level5,drift`): level3's median time to alert 21 -> 28
  steps (10k) and 72 -> 77 (100k), drift 125 -> 132 and 131 -> 138, no miss; a 3-sd shift is near the
  smallest one reference can tell from seeds' wander at alpha over 10k steps (--quick: one such seed,
  phi 0, wander 0.31 sd, 65 -> 480 steps). The trend: a local quadratic over `wander_span` steps (8193;
  4097 saw about 0.6 of a rho-0.999 wander's sd, 8193 about 0.8); runs shorter than it keep the prior
  alone (a quadratic over a whole short run misreads the trend's curvature as wander).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from rldiag.app.analysis.calibration import Calibration, ar_mean_var
from rldiag.app.analysis.noise_transforms import _use_log, dequantise, finite_values, quantum, transform, two_part
from rldiag.app.analysis.onsets import quiet
from rldiag.app.analysis.reference_bars import _leave_one_out, _own_change_tops, _variance_bar, paired, window_bar
from rldiag.app.analysis.rolling_median import row_nanmedian
from rldiag.app.analysis.tail_sim import simulated_tails
from rldiag.app.analysis.trailing_stats import (
    _mad,
    _trailing_median,
    ar_diff_var,
    clean_impulses,
    median_var,
    partial_sd,
    points,
    rolling,
    thin_mean_var,
    thinned_phi,
)
from rldiag.app.analysis.zero_rate import ZeroRate, _zero_rate
from rldiag.app.data.trace import Trace

# The smallest noise sd a test is scaled by, per unit of the metric's level (or 1, where its level is
# below 1 and it is 0 or changes sign: `reference_model`): float32's unit roundoff. Trainers compute their metrics in float32 or coarser, so a
# difference under it is rounding. A GRPO loss is a sum of advantages x ratios (order 1) that cancel to
# about 0: a seed whose groups all had equal rewards logged exactly 0 from step 12 on, another seed kept
# its rounding noise (-2e-8), and against the first (a floor of 1e-9) the second was a level departure at
# 5.6 sd (tests/experiments/test_divergence_onsets.py; the case in tests/app/analysis/test_divergence.py).
RESOLUTION = 2.0**-24


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
        # The prior is the seeds' constant offset, which one seed cannot show; the slow wander it can show
        # (`own_wander`) is measured and added to it, the estimate between seeds (2+) shrunk towards the sum.
        wander = 0.0 if split else own_wander(vals, config, sigma, phi)
        spread = float(np.sqrt(prior + wander if n < 2 else max(((n - 1) * est + k0 * prior) / (n - 1 + k0), wander)))
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
        innov_sd = max(innov_sd, rounding) if innov_sd > 0 else 0.0  # no impulse under the rounding (clean_impulses)

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
        if cal is not None and config.tail_points > 0 and not split:
            cal.tails = simulated_tails([points(resid[:, j], split) for j in range(n)], phi_w, config, own_of,
                                        change_sd, clean)
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
            change_bar = tuple(max(k_floor, cal.model(q) * np.sqrt(1 + 1 / n),
                                   cal.extrapolate(q, max(own, pair), test=("change", q)),
                                   cal.extrapolate(q, loo, test=("change", q)))
                               for (q, _), own, pair, loo in zip(config.change_windows, own_change, pair_change,
                                                                 loo_change))
        diff_scale, var_bar = _variance_bar(vals, sigma, phi, config, compress=split)
        diff_scale = max(diff_scale, rounding)
        zeros = _zero_rate(raw, config) if split else None
    noise = NoiseModel(log, sigma, phi, spread, n, tuple(null_sd), change_sd, tuple(thresholds), ref_nonfinite,
                       diff_scale, var_bar, change_bar, fill, innov_sd, tuple(owns))
    ref_ok = np.isfinite(raw).any(axis=1) if raw.shape[1] else np.zeros(len(steps), bool)
    return RefModel(steps, vals, center, log_floor, noise, ref_ok, zeros, q)


def own_wander(vals: np.ndarray, config, sigma: float, phi: float) -> float:
    """The slow wander the references themselves show: the variance of each seed's level (medians of
    consecutive blocks as long as the longest tested window) around a local quadratic trend over
    `config.wander_span` steps, less the part its own fast noise explains (AR(1): `ar_mean_var`); the mean
    over seeds. 0 where a run holds fewer points than the span (its wander cannot be told from its trend)."""
    m = config.windows[-1]
    blocks = vals.shape[0] // m
    if config.wander_span <= 0 or blocks < 3:
        return 0.0
    with quiet():
        per_block = vals[:blocks * m].reshape(blocks, m, vals.shape[1])
        finite = np.isfinite(per_block).sum(axis=1)
        level = (np.median(per_block, axis=1) if (finite == m).all()  # nanmedian only where needed: 5x slower
                 else np.where(finite > m // 2, np.nanmedian(per_block, axis=1), np.nan))
    noise = median_var(phi) * sigma**2 * ar_mean_var(m, phi)
    span = max(config.wander_span // m, 3) | 1  # in blocks
    out = []
    for j in range(vals.shape[1]):
        if np.isfinite(vals[:, j]).sum() < config.wander_span:
            continue
        dev = level[:, j] - local_quadratic(level[:, j], span)
        if np.isfinite(dev).sum() > 2:
            out.append(max(float(np.nanmean(dev**2)) - noise, 0.0))
    return float(np.mean(out)) if out else 0.0


def local_quadratic(x: np.ndarray, span: int) -> np.ndarray:
    """At each point, the least-squares quadratic through the finite points of the `span` points centred
    on it (clipped to the run; NaN where it holds under span / 4), from cumulative sums: O(len(x))."""
    n = len(x)
    ok = np.isfinite(x)
    t = (np.arange(n) - n / 2) / span  # scaled: moments of order 4 stay well inside float64
    cum = [np.concatenate([[0.0], np.cumsum(np.where(ok, w, 0.0))]) for w in
           [t**k for k in range(5)] + [x * t**k for k in range(3)]]
    i = np.arange(n)
    lo, hi = np.maximum(i - span // 2, 0), np.minimum(i + span // 2 + 1, n)
    raw = [a[hi] - a[lo] for a in cum]
    # moments about each point: sum (t - t_i)^k = sum_j C(k, j) t^j (-t_i)^(k - j)
    binom = ((1,), (1, 1), (1, 2, 1), (1, 3, 3, 1), (1, 4, 6, 4, 1))
    mom = [sum(b * raw[j] * (-t) ** (k - j) for j, b in enumerate(binom[k])) for k in range(5)]
    rhs = [sum(b * raw[5 + j] * (-t) ** (k - j) for j, b in enumerate(binom[k])) for k in range(3)]
    out = np.full(n, np.nan)
    good = mom[0] >= max(3, span // 4)
    a = np.stack([np.stack([mom[r + q] for q in range(3)], -1) for r in range(3)], -2)[good]
    out[good] = np.linalg.solve(a, np.stack(rhs, -1)[good][..., None])[:, 0, 0]
    return out


def _interpolate(x: np.ndarray) -> np.ndarray:
    """NaN between finite values filled by linear interpolation over the index (the ends stay NaN)."""
    ok = np.flatnonzero(np.isfinite(x))
    if len(ok) < 2:
        return x
    out = x.copy()
    inner = np.arange(ok[0], ok[-1] + 1)
    out[inner] = np.interp(inner, ok, x[ok])
    return out
