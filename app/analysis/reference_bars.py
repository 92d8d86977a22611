"""The bars a candidate is tested against, from what the references reach on each test: their own
residuals, each less the centre's (`paired`), each left out against the others (`_leave_one_out`), carried
to the target false-alarm rate (`window_bar`, the change bars' tops, `_variance_bar`).

Why (measured on `bench.divergence_rl`, RL-like noise):
- Spikes and short bursts happen in every run: the test is on trailing medians of at least
  `windows[0]` points (a burst of fewer than half a window cannot move them), and the threshold of each
  window rises above the largest value the references' own residuals reach on it (self-calibrating:
  a reference with 4-step bursts makes the 5-point window demand more).
- With 2 or more references, each is also scored as a candidate against the centre of the others over
  its whole run, and every bar rises to what they reach: how far seeds wander apart, and how far a
  longer run reaches (tested at more positions), come from the references themselves.
- Bars from a target false-alarm rate (`DivergenceConfig.alpha`, default 0.001: the chance that a
  no-change candidate as long as the references gets a false departure on one metric, so a page of 10
  candidates x 8 metrics rarely shows one). A statistic tested at every step of a longer run reaches
  further, so a bar fixed in sd is a rate that grows with the run (at 100k steps it flagged 23 of 32
  held-out no-change candidates of bench.divergence_length). Each bar is at least the level that normal
  AR(1) noise crosses with probability alpha over the references' length (`calibration.Calibration`:
  L / span looks of a statistic that stays alike over `span` steps, crossing u^2 times as often as
  independent values), and at least the largest value the references reach (their own residuals; with 2
  or more, each left out against the others) carried from the run(s) they were measured on to the
  target by the same ratio, or by the one the references' own noise has when simulated where that is more
  (`tail_sim`): heavy tails, bursts and decaying impulses raise it by as much as they reach beyond normal
  noise. `k`, `k_per_halving` and `k_change`/`k_change_loo` stay as floors: with the model
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
"""

from __future__ import annotations

import numpy as np

from rldiag.app.analysis.calibration import Calibration
from rldiag.app.analysis.rolling_median import row_nanmedian
from rldiag.app.analysis.trailing_stats import _MAD, _trailing_median, candidate_scale, change_z, points


def paired(own: list[np.ndarray], centre: np.ndarray) -> list[np.ndarray]:
    """Each reference's own residual less the centre's (`centre`, around the same wide smooth) half a run
    away: what a candidate's residual holds, its own noise and the centre's at an unrelated time."""
    return [x - np.roll(centre, len(centre) // 2) for x in own]


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
            zc = change_z(med[q], med[p], q, sd)
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
            zc = change_z(trailing(j, q), trailing(j, p), q, sd)
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
