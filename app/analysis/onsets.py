"""Where a departure starts, placed after the fact (issue 43 item 3): the detector's `Stretch`, the split
before its alert (`cusum_onset` for a level, `variance_onset` for a noisier stretch) that the detector's end
and merge rules measure from, and the onset reported, `first_out`: the first point from the split that is out
of the band after the last quiet run, so never before a point that is itself out. The figures per change
kind are bench.divergence_quality's and bench.divergence_length's (bench/README.md, "Onsets with a stated
error"); the tests are tests/app/analysis/test_onsets.py."""

from __future__ import annotations

import math
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True)
class Stretch:
    """One stretch where the candidate is outside the references' noise (indices into the compared steps)."""

    kind: str  # "level", "variance" or "nonfinite"
    onset: int  # index (into the compared steps) where it starts, placed after the fact (the CUSUM split)
    alert: int  # index at which a causal scan first reports it (a watcher polling every step)
    end: int | None  # last index of it; None while it lasts to the candidate's end
    sign: int  # +1 above, -1 below (0 for variance / nonfinite)
    window: int  # the trailing window that reported it
    shown: int | None = None  # the onset reported: the first point out of the band from `onset` (`first_out`)

    @property
    def start(self) -> int:
        """The index a departure is reported to start at: `shown` where the band says, else `onset`."""
        return self.onset if self.shown is None else self.shown


def cusum_onset(r: np.ndarray, alert: int, level: float, lookback: int) -> int:
    """Where the stretch ending at `alert` starts: the split maximising the CUSUM of (r - level/2). The
    detector's own rules (`not_back`, `came_back`, a level stretch inside a noisier one) measure the
    stretch from here; the onset reported is `first_out` from here."""
    lo = max(0, alert - lookback)
    seg = r[lo:alert + 1] * np.sign(level)
    ok = np.isfinite(seg)
    if ok.sum() < 2:
        return alert
    x = np.clip(np.where(ok, seg, 0.0) - abs(level) / 2, -abs(level), abs(level))
    x[~ok] = 0.0
    tail = np.cumsum(x[::-1])[::-1]  # tail[s] = sum of x[s:]
    return lo + int(np.argmax(tail))


def first_out(x: np.ndarray, split: int, alert: int, edge: float, gap: int) -> int:
    """The reported onset: the first point from `split` to `alert` whose `x` is beyond the band's `edge`
    (its half-width) that is not followed by `gap` or more points inside before the next one out (such a
    run ends the evidence: what came before it was noise); with no point out, `alert`. So the onset is
    never before the first point out of the band. The split alone put 5 of 31 changed candidates 1 to 35
    steps before the change (bench.divergence_quality), where the seeds' wander, a burst or a spike
    before it kept the sum rising. The band, per kind:
    - level: x = the residual (compared scale, as the level test reads it) times the stretch's sign;
      edge = the narrowest of the level windows' bands once full, bar x null sd (the longest window's,
      as a rule: the band `compute_band` draws by default), without the min_delta / rel_delta floor.
      The reporting window's own band (4.7 sd for the 11-point window with one reference) held most
      points of a 3-sd shift inside and put its onset up to 17 steps late. gap: the shortest window
      (`windows[0]` points inside in a row: its median is back inside);
    - variance: x = the step-to-step change |x_t - x_(t-1)|; edge = `var_bar` x the references' robust
      scale of their changes (the variance test's bar, on one change); gap: VAR_ONSET_GAP.
    A drift has no sharp start: its first point out is where it has carried the candidate to the band's
    edge (0.03 sd/step reaches a 2-3 sd band 60-100 steps on), and that is where its onset is placed."""
    with np.errstate(invalid="ignore"):  # NaN (an unlogged step) is not out
        out = np.flatnonzero(x[split:alert + 1] > edge)
    if not len(out):
        return alert
    breaks = np.flatnonzero(np.diff(out) > gap)  # `gap` points or more inside between two out
    return split + int(out[breaks[-1] + 1] if len(breaks) else out[0])


# Step-to-step changes in a row inside the variance band that end the evidence before them (`first_out`).
# bench.divergence_quality, seeds 0-39: with 11 (the shortest window) or 16 (half the variance window), a
# spike 10 steps before a variance change (two changes far beyond the bar) set 2 of 40 onsets 11-13 steps
# early; with 8 none is, and 3 of 40 are > 10 steps late: a noisier stretch can hold 8 quiet changes in a
# row (tests/app/analysis/test_divergence_rl.py, seed 7: 13 in a row, its onset 35 steps late).
VAR_ONSET_GAP = 8


def variance_onset(abs_diff: np.ndarray, alert: int, ref_scale: float, ratio: float, lookback: int) -> int:
    """Where a noisier stretch ending at `alert` starts: the split maximising the tail sum of each step's
    log-likelihood ratio of "step-to-step changes `ratio` times the references'" against "as the
    references'" (normal changes; each change capped at 3 reference sd, so a spike or burst before the
    onset cannot pull it back). A count of changes over a fixed cut placed one onset 35 steps late where
    the first 30 noisy steps happened to hold few large changes. The onset reported is `first_out` from it."""
    lo = max(0, alert - lookback)
    u2 = np.minimum((abs_diff[lo:alert + 1] / ref_scale) ** 2, 9.0)
    x = np.where(np.isfinite(u2), 0.5 * u2 * (1 - 1 / ratio**2) - np.log(ratio), 0.0)
    tail = np.cumsum(x[::-1])[::-1]
    return lo + int(np.argmax(tail))


@contextmanager
def quiet():
    """numpy warns on all-NaN slices (steps no reference logged); those steps are simply not compared
    (the detector's too: `detector` imports it from here)."""
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def not_back(r: np.ndarray, stretches: list) -> list:
    """The scan's stretches, a level one that ended kept out where the candidate did not come back: over the
    steps from its end to the next level stretch's onset (or the run's end), the residual's median is still
    half its size or more on its side. Such a stretch runs on to the end, or into the next one on its side
    (one departure, not two). The detector's end rule (a window's median back under half its bar) can
    fire on a small lasting shift: 3 of 59 lasting shifts of 1.5-6 noise sd "ended" while they lasted."""
    out = list(stretches)
    i = 0
    while i < len(out):
        s = out[i]
        if s.kind != "level" or s.end is None or not s.sign:
            i += 1
            continue
        nxt = next((j for j in range(i + 1, len(out)) if out[j].kind == "level"), None)
        stop = out[nxt].onset if nxt is not None else len(r)
        with quiet():
            size = float(np.nanmedian(r[s.onset:s.end + 1] * s.sign))
            after = float(np.nanmedian(r[s.end + 1:stop] * s.sign)) if stop > s.end + 1 else size
        if not (math.isfinite(size) and size > 0 and math.isfinite(after) and after >= size / 2):
            i += 1
            continue
        if nxt is None:
            out[i] = replace(s, end=None)
        elif out[nxt].sign == s.sign:  # one departure: its onset and alert, the later one's end
            out[i] = replace(s, end=out[nxt].end)
            del out[nxt]
            continue  # the merged stretch may run on again
        i += 1
    return out


def came_back(r: np.ndarray, s) -> int:
    """Index of the last step a level stretch `s` that ended is out: after its alert, the split that
    maximises the sum of (its sign x residual - half its size) up to it (the onset's CUSUM split, run
    forwards). The detector ends a stretch once a window's median is back inside for a window's length,
    which lags the candidate's return by up to half that window."""
    if s.end is None or s.end <= s.alert:
        return s.end if s.end is not None else len(r) - 1
    with quiet():
        size = float(np.nanmedian(r[s.onset:s.end + 1] * s.sign))
    if not (math.isfinite(size) and size > 0):
        return s.end
    x = np.clip(r[s.alert:s.end + 1] * s.sign - size / 2, -size, size)
    x[~np.isfinite(x)] = 0.0
    return s.alert + int(np.argmax(np.cumsum(x)))
