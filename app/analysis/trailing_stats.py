"""The trailing statistics every part of the detector shares: rolling medians and means, a trailing
window's median and its sd where the window is partly filled, impulse cleaning, the candidate's scale.

Why:
- A trailing window holding fewer points than its length (a run's first steps, after a gap) is tested
  with the sd of a median of the points it holds (`partial_sd`), in the candidate as in the references'
  own and left-out scores: a 3-step warm-up burst in the first 6 points no longer reads as a shift.
  Where such a window holds an even count, its statistic is the middle point nearer the centre, not the
  mean of the two (`_even_toward_zero`): a burst of half its points makes one of them. Measured on
  bench.divergence_length `warmup` with 2-4 references (tuning seeds, 1k steps 0-239 and 10k 0-39): of 8
  flagged at steps 5-6, 3 no longer are; the 5 left hold 4 outlying points of 6-7 (a burst and a spike).
"""

from __future__ import annotations

import bisect
import math

import numpy as np
import pandas as pd

from rldiag.app.analysis.calibration import ar_mean_var
from rldiag.app.analysis.onsets import quiet
from rldiag.app.analysis.rolling_median import rolling_median

_MAD = 1.4826  # MAD -> standard deviation for normal noise


def median_var(phi: float) -> float:
    """Variance of a window's median / of its mean: pi/2 for independent normal points, nearer 1 the
    more alike neighbours are (simulated: 1.49, 1.27, 1.18, 1.09 at phi 0, 0.3, 0.6, 0.85)."""
    return 1.0 + 0.5 * (1.0 - phi)


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
    """The residual `r` with the echo of each jump taken out. Under AR(1) noise one heavy-tailed innovation
    (11-15 sd) is not one point but a geometric excursion (phi^k) that the trailing medians read as a shift:
    bench.divergence_length's `jump` (tuning seeds, 1k steps) flagged 4 of 60 candidates five steps after
    it (on the 11-step window and the (11, 33) change test, phi 0.85); 3 of the 4 no-change 100k-step
    candidates once flagged were echoes of a 30-70 sd innovation. Each AR(1) innovation (r_t - phi r_(t-1))
    beyond `clip` innovation sd is an impulse, and the next one tells which (`_impulse_cuts`): a jump (the
    next is ordinary) has the part beyond the clip taken out of the steps after as the noise carries it
    (phi^k); a spike (-phi times it next) and a huge shift leave the points after them as they are. Taken
    for jumps, a 26-sd spike's echo pushed the next steps 4 sd down (a 3-sd shift 3 steps on was found 46
    steps late, tests/app/analysis/test_divergence_rl.py) and a 45-sd step of a rounding-level metric was
    cut to 10 sd at each step (test_divergence.py). A smaller lasting shift is taken for a jump at first:
    its later innovations each carry (1 - phi) of it, which rebuilds the level at the noise's pace, and
    once they add up to a shift's its echo is left in from there (`_shift_after_all`). The
    impulse's own point stays: one point, as a spike is. Causal (step t uses the steps up to t), so a
    prefix of a run is cleaned as the whole run is; a point with no finite one before it is judged alone
    (below). The references are cleaned too (their centre and the bars they set: `reference_model`).
    `DivergenceConfig.impulse_clip` (10; 0: off). Tuning seeds of bench.divergence_length, off -> on: 10 -> 1
    false alarms of 368 no-change candidates (`jump` at 1k steps 4 -> 0), 10 -> 0 early alerts of 460, 1 miss
    as before, median time to alert (shifts of 3 sd and up) 10 -> 9 steps; `--refs 1` 34 -> 16 of 368.
    Plain clipping (every impulse taken for a jump) had 2 false alarms of 368 there but the failures above."""
    if not (clip > 0 and innov_sd > 0 and phi > 0) or len(r) < 2:
        return r
    # a point with no finite one before it (the run's first, the first after a gap) is judged on its own,
    # its deviation in the stationary sd (innov_sd / sqrt(1 - phi^2)); a spike there makes the next
    # innovation -phi times it, which says it was a spike (not a shock the other way)
    ar = np.sqrt(1.0 - min(phi, 0.99) ** 2)
    u = np.empty(len(r))
    u[0] = r[0] * ar
    with quiet():
        u[1:] = np.where(np.isfinite(r[:-1]), r[1:] - phi * r[:-1], r[1:] * ar)
    lim = clip * innov_sd
    alone = np.r_[True, ~np.isfinite(r[:-1])]
    excess = _impulse_cuts(u, alone, phi, ar, lim, innov_sd)
    if not excess.any():
        return r
    return r - ar1_filter(excess, phi)


def change_z(recent: np.ndarray, prior: np.ndarray, q: int, sd: float) -> np.ndarray:
    """The change test's statistic: the recent trailing median less the prior window's as it stood `q`
    steps before (NaN for the first q), in `sd`."""
    before = np.roll(prior, q)
    before[:q] = np.nan
    with quiet():
        return (recent - before) / sd


def ar1_filter(e: np.ndarray, phi: float) -> np.ndarray:
    """x_t = phi x_(t-1) + e_t from x_(-1) = 0: scipy's `lfilter` where the app extra installed it, else a
    loop (a training-side install, .venv-trl11, reads runs without scipy)."""
    try:
        from scipy.signal import lfilter
    except ImportError:
        out, x = np.empty(len(e)), 0.0
        for i, v in enumerate(e.tolist()):
            x = phi * x + v
            out[i] = x
        return out
    return lfilter([1.0], [1.0, -phi], e)


# An innovation beyond the clip is judged by the next one (`_impulse_cuts`) only where that one is itself out of
# the noise (beyond this many innovation sd); else it is taken for a jump, whose next innovation is ordinary
KIND_SD = 3.0
IMPULSE_CHUNK = 512  # positions a shifted level's impulses are looked for at a time (`_impulse_cuts`)
KIND_STEPS = 8  # a jump is taken for a shift if the next (up to 8) innovations add up to a shift's beyond KIND_SD


def _impulse_cuts(u: np.ndarray, alone: np.ndarray, phi: float, ar: float, lim: float, innov_sd: float) -> np.ndarray:
    """What `clean_impulses` takes out at each step (the AR(1) filter's input, residual units). An innovation
    beyond `lim` leaves its own point as it is (one point); the next innovation v says what it was, as the
    nearest of what each kind makes of an impulse A: a jump (an innovation outlier) 0, the part of it beyond
    `lim` then taken out of the steps after as the noise carries it; a spike (one point off) -phi A; a
    shift (1 - phi) A where that is beyond `lim` (a smaller one is told by the steps after: `_shift_after_all`),
    the points after them then as they are. v within KIND_SD sd: a jump. Such a shift moves the level the
    later innovations are measured from until they are back (else each would be cut again: a 45-sd step of
    a rounding-level metric read as a 10-sd one).
    Causal: step t's output depends on the innovations up to t. A loop over the impulses alone."""
    n = len(u)
    q = 1.0 - phi  # what a shift of 1 adds to each later innovation (ar after a gap)
    out = np.zeros(n)
    with quiet():
        hits0 = np.flatnonzero(np.abs(u) > lim)  # the impulses at level 0
    if not len(hits0):
        return out
    # Positions are visited in increasing order and `backd` is written only at the next one, so wherever the
    # hits are found again (after a shift, or back at level 0) every later `backd` is still 0: at level 0 they
    # are `hits0`'s later ones; after a shift they are found a chunk at a time, as the loop reaches them (found
    # over the whole rest at each shift, a drifting candidate far from its references, an impulse at most of
    # its steps and a shift at many, took 0.15-0.3 s a detection). Python floats where there are many impulses
    # (a numpy scalar read is several times slower than a list's).
    ul, alonel = (u.tolist(), alone.tolist()) if len(hits0) > 256 else (u, alone)
    h0 = hits0.tolist()
    backd: dict[int, float] = {}  # a spike's way back, explained in the next innovation (step -> residual units)
    jumps: list[tuple[int, float, float, float]] = []
    level, hits, i, found_to = 0.0, h0, 0, n  # hits holds every impulse of this level from hits[i] to found_to

    def refill(start: int) -> tuple[list[int], int]:  # the impulses at `level` in the next chunk from `start`
        end = min(n, start + IMPULSE_CHUNK)
        with quiet():
            w = u[start:end] - level * np.where(alone[start:end], ar, q)
            return (start + np.flatnonzero(np.abs(w) > lim)).tolist(), end

    while True:
        if i >= len(hits):
            if found_to >= n:
                break
            (hits, found_to), i = refill(found_to), 0
            continue
        s = hits[i]
        i += 1
        bs = backd.get(s, 0.0)
        if level and abs(ul[s] + bs) <= lim:  # back where it was before the shift (or it was none)
            level, hits, i, found_to = 0.0, h0, bisect.bisect_right(h0, s), n
            continue
        a = ul[s] - level * (ar if alonel[s] else q) + bs
        if not abs(a) > lim or s + 1 >= n:
            continue
        scale = ar if alonel[s] else 1.0
        cut, size = (a - max(-lim, min(lim, a))) / scale, a / scale
        v = ul[s + 1] - level * (ar if alonel[s + 1] else q) + backd.get(s + 1, 0.0)
        if alonel[s + 1] or not math.isfinite(v):
            continue  # nothing after it to tell what it was: left as it is
        # a shift is told from a jump in one step only where (1 - phi) of it is beyond the clip: at phi 0.8-0.85
        # a 12-sd jump's next innovation was 3-4 sd (the noise plus phi's error times it), nearer a shift's 4.4
        saturated = (1.0 - phi) * abs(size) > lim
        spike, shift = abs(v + phi * size), abs(v - (1.0 - phi) * size) if saturated else math.inf
        if abs(v) <= KIND_SD * innov_sd or min(spike, shift) >= abs(v):
            out[s + 1] += phi * cut  # a jump: its echo comes out from the next step on
            jumps.append((s, cut, size, level))
        elif spike <= shift:
            backd[s + 1] = backd.get(s + 1, 0.0) + phi * size  # the next innovation may be an impulse of its own
            while i >= len(hits) and found_to < n:  # the next impulse found, to compare with
                (hits, found_to), i = refill(found_to), 0
            if abs(v + phi * size) > lim and (i >= len(hits) or hits[i] != s + 1):
                hits.insert(i, s + 1)
        else:  # a shift so large that each later innovation is out by itself
            level += size
            hits, i, found_to = [], 0, s + 1
    if jumps:
        back = np.zeros(n)
        back[list(backd)] = list(backd.values())
        _shift_after_all(out, jumps, u, np.where(alone, ar, q), back, alone, phi, innov_sd)
    return out


def _shift_after_all(out: np.ndarray, jumps: list, u: np.ndarray, adj: np.ndarray, back: np.ndarray,
                     alone: np.ndarray, phi: float, innov_sd: float) -> None:
    """Each jump (step, cut, size, level then) whose next KIND_STEPS innovations add up to a shift's
    ((1 - phi) of it each, beyond KIND_SD sd of their sum): its echo left in from that step on (in `out`)."""
    n = len(u)
    s, cut, size, lev = (np.array(c) for c in zip(*jumps))
    k = np.arange(1, KIND_STEPS + 1)
    idx = s[:, None] + k
    ok = idx < n
    idx = np.minimum(idx, n - 1)
    with quiet():
        vals = u[idx] - lev[:, None] * adj[idx] + back[idx]
        ok &= np.isfinite(vals) & ~alone[idx]
        ok = np.cumsum(~ok, axis=1) == 0  # up to a gap or the run's end
        tot = np.cumsum(np.where(ok, vals, 0.0), axis=1)
        lead = ok & (np.abs(tot) > KIND_SD * np.sqrt(k) * innov_sd)
        lead &= np.abs(tot - k * (1.0 - phi) * size[:, None]) < np.abs(tot)
    found = lead.any(axis=1)
    if found.any():
        j = np.argmax(lead[found], axis=1) + 1  # the step it is taken for a shift at
        np.add.at(out, s[found] + j, -(phi ** j) * cut[found])


def points(x: np.ndarray, compress: bool) -> np.ndarray:
    """`x`'s finite points alone where `compress` (the two-part comparison: windows count points, so a
    burst of fewer than half a window's points cannot move its median, whatever the zeros around it)."""
    return x[np.isfinite(x)] if compress else x


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


def trailing_mean(x: np.ndarray, m: int) -> np.ndarray:
    """Mean of the finite points among the last `m` up to each index (NaN until `min_points(m)`)."""
    return rolling(x, m, "mean", center=False, min_periods=min_points(m))


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
