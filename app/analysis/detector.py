"""The departure test behind `detect_divergence`: a causal scan of the candidate against a noise model
learnt from the references.

Where each part lives (each module's docstring says why its rules are there; all import from here too):
- `noise_transforms`: the compared scale (logs or linear, lattice values dequantised, `two_part`);
- `reference_model`: `reference_model` (`RefModel`, `NoiseModel`): centre, noise, seed spread, null sds;
- `reference_bars`: the bars from what the references reach (own, `paired`, left out, carried to alpha);
- `calibration`, `tail_sim`: the ratio that carries them to alpha (normal noise's, or the references' own
  noise simulated where that reaches further);
- `zero_rate`: the two-part comparison's zeros (`ZeroRate`: trailing zero fractions, runs of zeros);
- `trailing_stats`: trailing medians and means, partly filled windows, impulses, the candidate's scale;
- here: the causal scan (`scan`, `level_residual`, `detectable_shift`, `spacing`).

Why this shape:
- Causal: the candidate's statistic at step t uses only its points up to t, so the step at which a
  departure is first reported on the full run (`alert_step`) is the one a watcher polling every step
  reports it at. The onset is placed after the fact: a CUSUM split before the alert, then the first
  point from it out of the band (`first_out`, which defines the band), so it is never before the first
  point out; a drift has no sharp start, and its onset is where it and the noise first pass the band.
"""

from __future__ import annotations

import numpy as np

from rldiag.app.analysis.calibration import ar_mean_var
from rldiag.app.analysis.noise_transforms import (
    MAX_FLOAT,
    MAX_LATTICE_VALUES,
    MAX_ZEROS,
    MIN_TWO_PART_VALUES,
    dequantise,
    finite_values,
    quantum,
    transform,
    two_part,
)
from rldiag.app.analysis.onsets import (
    VAR_ONSET_GAP,
    Stretch,
    cusum_onset,
    first_out,
    not_back,
    quiet,
    variance_onset,
)
from rldiag.app.analysis.reference_bars import paired, window_bar
from rldiag.app.analysis.reference_model import RESOLUTION, NoiseModel, RefModel, reference_model
from rldiag.app.analysis.trailing_stats import (
    MIN_FILL,
    _trailing_median,
    abs_diffs,
    ar_diff_var,
    candidate_scale,
    change_z,
    clean_impulses,
    median_var,
    min_points,
    partial_sd,
    points,
    rolling,
    thin_mean_var,
    thinned_phi,
    trailing_mean,
)
from rldiag.app.analysis.zero_rate import (
    RUN_ALPHA,
    RUN_FACTOR,
    ZeroRate,
    _run_stretches,
    chance_run,
    longest_zero_run,
    zero_indicator,
)

# Re-exported: every name the detector had before its parts moved out imports from here as before.
__all__ = [
    "MAX_FLOAT", "MAX_LATTICE_VALUES", "MAX_ZEROS", "MIN_FILL", "MIN_TWO_PART_VALUES", "RESOLUTION", "RUN_ALPHA",
    "RUN_FACTOR", "NoiseModel", "RefModel", "ZeroRate", "_trailing_median", "abs_diffs", "ar_diff_var", "ar_mean_var",
    "candidate_scale", "chance_run", "clean_impulses", "dequantise", "detectable_shift", "finite_values",
    "level_residual", "longest_zero_run", "median_var", "min_points", "paired", "partial_sd", "points", "quantum",
    "quiet", "reference_model", "rolling", "scan", "spacing", "thin_mean_var", "thinned_phi", "trailing_mean",
    "transform", "two_part", "window_bar", "zero_indicator",
]


def spacing(pos: np.ndarray) -> int:
    """The candidate's typical gap between compared points, in the references' logged steps (1: it logs
    where they do; 5: a candidate with `logging_steps=5` against references that log every step)."""
    return max(1, round(float(np.median(np.diff(pos))))) if len(pos) > 2 else 1


def scan(r: np.ndarray, cand_bad: np.ndarray, cand_resid_scale: np.ndarray, noise: NoiseModel,
         config, cand_abs_diff: np.ndarray | None = None, zero_ind: np.ndarray | None = None,
         zeros: ZeroRate | None = None, zero_rate: np.ndarray | None = None,
         level: np.ndarray | None = None) -> list[Stretch]:
    """Every departure of the residual `r` (candidate - centre, compared scale) in order of time.

    `cand_bad`: candidate non-finite where a reference is finite; `cand_resid_scale`: trailing robust
    scale of the candidate's first differences (for variance departures); `zero_ind` (two-part
    comparison, with `zeros`): the candidate's 0/1 exact-zero indicator, `zero_rate` the references'
    rate at its steps. `level`: `level_residual(r, noise, config)` where the caller has it already."""
    n = len(r)
    full_r = r
    keep = np.flatnonzero(np.isfinite(r)) if noise.fill < 1 else None  # level windows count points
    r = level_residual(r, noise, config) if level is None else level
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
            zc = change_z(trailing(q), trailing(p), q, sd)
            end_m = q if q in level else config.windows[0]
            # a change counts only away from the centre and while the recent level is not back inside
            # (the end rule's half bar): a return from a departure is a change too, not a departure
            lvl = level[end_m]
            bar = noise.threshold[list(config.windows).index(end_m)]
            zc = np.where((np.sign(zc) == np.sign(lvl)) & (np.abs(lvl) >= bar / 2), zc, 0.0)
            tests.append((q, zc, change_bar, end_m, q + p, sd))
    edge = min(th * sd for th, sd in zip(noise.threshold, noise.null_sd))  # `first_out`'s band
    # the onset reported is the first point out as the chart draws it: before the echoes are cleaned off
    # (with them cleaned, 2 of 514 held-out onsets of bench.divergence_quality were at a point inside the band)
    raw = full_r[np.isfinite(full_r)] if noise.fill < 1 else full_r
    out = _stretches(r, tests, level, noise.threshold, config.windows, config.window, "level", edge, raw)
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


def detectable_shift(r: np.ndarray, noise: NoiseModel, config, level: np.ndarray | None = None) -> float:
    """The smallest lasting shift (compared scale) that some test of `scan` flags, in either direction,
    given where the candidate sits now: a level window (the longest that fills) flags a shift once it
    crosses the far side of its bar, so one against the candidate's own offset from the centre needs that
    offset more; a change test (one whose two windows fill) needs its bar in its own sd, and the level
    it reports on past half its bar. A candidate 0.9 noise sd above the centre that falls by 3 sd ends
    2.1 sd below it: under the level bar, and for the change test a step the seeds' wander can make."""
    x = level_residual(r, noise, config) if level is None else level
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
               edge: float | None = None, raw: np.ndarray | None = None) -> list[Stretch]:
    """Departures of the residual `r` by `tests` ((window, z, bar, window whose level z says when it is
    over, steps it looks back, its null sd) each): any test beyond its bar; each stretch ends once the
    reporting window's level is back under half its bar for as many steps as the window is long. Where
    each test is beyond its bar, and where each (window, sign) is back inside for a whole window, is
    found once for the run, then looked up per stretch (a long noisy run has hundreds of stretches).
    `edge`: the band's half-width a point must pass for the onset reported (`first_out`, on `raw`: the
    residual before `clean_impulses`, else `r`); None: the split."""
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
        shown = None if edge is None else first_out((r if raw is None else raw) * sign, onset, a, edge, windows[0])
        back = first_back(end_m, sign, bars[wi], a)
        if back is not None:
            end = max(back - 1, a)
            out.append(Stretch(kind, onset, a, end, sign, m, shown))
            i, last_end = end + 1, end
        else:
            out.append(Stretch(kind, onset, a, None, sign, m, shown))
            break
    return out
