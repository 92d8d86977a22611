"""Where a candidate run leaves its reference: per metric, the first step from which it stays outside
the reference's noise band, and by how much.

The band, at each step (on the steps the candidate logged):
- centre: the median across reference seeds of each seed's centred rolling median (`window` steps);
  a centred median shifts exactly at a step change, so the onset is not smeared forward;
- half-width: `k` x the combined noise of the comparison, that is the point noise of the reference
  (a robust, local MAD of its residuals around its rolling median) shrunk to the noise of a rolling
  median, plus the spread between the seeds' smoothed curves (robust MAD across seeds): seeds of
  one configuration wander apart; a band of several seeds knows by how much, a single reference run
  cannot, so pass several seeds where you have them;
- floors `min_delta` (absolute) and `rel_delta` (fraction of the centre) keep a flat reference (a
  clip rate of exactly 0) from calling every rounding difference a departure.

A departure is `persist` consecutive compared steps on one side outside the band (one spike does
not make one); its onset is then placed by the best two-piece fit of the raw deviation within a
window of the first outside step (a centred median can cross up to half a window early). Also: the candidate non-finite for `persist` steps where the reference is finite
(`kind="nonfinite"`), and its residual noise `var_ratio` times the reference's (`kind="variance"`).
The earliest of the three is reported. Considered: `ruptures` (offline change-point segmentation);
it finds where one series changes, not where one leaves another's band, and needs a penalty per
metric scale; this band test is a few vectorised rolling medians.

A candidate without a departure on fewer compared steps than `DivergenceConfig.min_steps` is "not
enough steps" (`Divergence.status`), never "within": `persist` steps cannot run outside a band on
fewer. `summarize` says per candidate what the comparison shows, for the headlines of the report,
the dashboard and `rldiag report`: non-finite gradients first, then the first departure, then how
much was compared (metrics with not enough steps, not compared, or no longer logged).
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from rldiag.app.data.align import align_by_step
from rldiag.app.data.trace import Trace

if TYPE_CHECKING:
    from rldiag.app.data.histories import Histories

_MAD = 1.4826  # MAD -> standard deviation for normal noise
_MEDIAN_SE = 1.2533  # standard error of a median / of a mean (sqrt(pi/2)), large samples


@dataclass(frozen=True)
class DivergenceConfig:
    window: int = 9  # rolling-median window, in compared steps (odd)
    k: float = 3.5  # band half-width, in noise units of the comparison
    persist: int = 15  # consecutive outside steps (one side) that make a departure
    scale_window: int = 101  # steps over which the noise scales are estimated (robust, local)
    var_ratio: float = 3.0  # candidate residual noise / reference noise that makes a variance departure
    min_delta: float = 0.0  # absolute floor on the half-width, in metric units
    rel_delta: float = 0.0  # floor on the half-width, as a fraction of |centre|

    def __post_init__(self):
        if self.window < 1 or self.window % 2 == 0:
            raise ValueError(f"window={self.window}: use an odd number of steps >= 1, e.g. 9")
        if self.persist < 1 or self.k <= 0 or self.scale_window < 3 or self.var_ratio <= 1:
            raise ValueError(f"invalid {self}: need persist >= 1, k > 0, scale_window >= 3, var_ratio > 1")

    @property
    def min_steps(self) -> int:
        """Compared steps a candidate needs before staying inside the band says anything: a departure
        is `persist` consecutive compared steps outside it, and the centred medians compare a step only
        once half a window of points surrounds it. Fewer, and no departure: "not enough steps"."""
        return max(self.persist, self.window // 2 + 1)


@dataclass(frozen=True)
class Band:
    """The reference band on the compared steps (for a chart to shade) and the candidate smoothed."""

    steps: np.ndarray
    center: np.ndarray
    lower: np.ndarray
    upper: np.ndarray
    noise: np.ndarray  # the reference's point noise (one standard deviation), per step
    candidate: np.ndarray  # the candidate's rolling median on the same steps


DIVERGED, WITHIN, NOT_ENOUGH_STEPS = "diverged", "within", "not_enough_steps"  # Divergence.status


@dataclass(frozen=True)
class Divergence:
    key: str
    onset_step: int | None  # first step of the departure; None: the candidate stays in the band
    kind: str | None  # "level", "variance" or "nonfinite"
    end_step: int | None  # last step of the departure; None while it lasts to the candidate's end
    delta: float  # median of (candidate - centre) over the departure, metric units (NaN if none)
    delta_sigma: float  # the same in units of the reference's point noise
    first_nonfinite_step: int | None  # the candidate's first NaN/inf where the reference is finite
    steps_compared: int
    steps_needed: int = DivergenceConfig().min_steps  # the config's min_steps

    @property
    def diverged(self) -> bool:
        return self.onset_step is not None

    @property
    def status(self) -> str:
        """DIVERGED (a departure was found), NOT_ENOUGH_STEPS (none, on fewer compared steps than the
        detector needs: 0 means nothing was compared) or WITHIN (none, on enough steps)."""
        if self.onset_step is not None:
            return DIVERGED
        return NOT_ENOUGH_STEPS if self.steps_compared < self.steps_needed else WITHIN

    @property
    def evidence(self) -> str:
        """The status in words: "diverged", "within the band", "not enough steps (8 compared, 15
        needed)" or "not compared (0 steps)"."""
        status = self.status
        if status == DIVERGED:
            return "diverged"
        if status == WITHIN:
            return "within the band"
        if self.steps_compared == 0:
            return "not compared (0 steps)"
        return f"not enough steps ({self.steps_compared} compared, {self.steps_needed} needed)"


def _first_run(mask: np.ndarray, n: int) -> int | None:
    """Index of the first run of at least `n` consecutive True values."""
    if n <= 1:
        hits = np.flatnonzero(mask)
        return int(hits[0]) if len(hits) else None
    c = np.concatenate([[0], np.cumsum(mask, dtype=np.int64)])
    full = (c[n:] - c[:-n]) == n  # full[i]: mask[i:i+n] all True
    hits = np.flatnonzero(full)
    return int(hits[0]) if len(hits) else None


def _rolling(a: np.ndarray | pd.DataFrame, w: int, how: str, min_periods: int = 1):
    frame = a if isinstance(a, pd.DataFrame) else pd.DataFrame(a)
    r = frame.rolling(w, center=True, min_periods=min_periods)
    return getattr(r, how)().to_numpy()


def compute_band(references: Sequence[Trace], candidate: Trace,
                 config: DivergenceConfig = DivergenceConfig()) -> tuple[Band, np.ndarray, np.ndarray]:
    """The band on the candidate's steps; also the candidate's raw values and the reference-present mask."""
    labels = {f"ref{i}": t for i, t in enumerate(references)}
    al = align_by_step({**labels, "cand": candidate})
    rows = al.present[:, -1]
    steps, cand = al.steps[rows], al.values[rows][:, -1]
    ref_part = _reference_part(tuple(references), steps.tobytes(), config)
    return _band(ref_part, steps, cand, config), cand, ref_part.ok


@dataclass(frozen=True, eq=False)
class _RefPart:
    """What the band needs from the references alone, on a given set of steps."""

    ref: np.ndarray  # the references' values on the steps (NaN where a seed has none or is non-finite)
    ok: np.ndarray  # any reference finite at the step
    smooth: np.ndarray
    center: np.ndarray
    noise: np.ndarray
    spread: np.ndarray  # robust spread of the seeds' smoothed curves (0 for one seed)
    n_seeds: np.ndarray
    n_ref: np.ndarray


@functools.lru_cache(maxsize=16)  # ~10 MB an entry at 100k steps x 3 seeds
def _reference_part(references: tuple[Trace, ...], steps_bytes: bytes, config: DivergenceConfig) -> _RefPart:
    """Cached per (references, steps): comparing many candidates that share their steps with one
    reference band (a report, the dashboard's grid) smooths the references once, not per candidate."""
    steps = np.frombuffer(steps_bytes, np.int64)
    ref = np.full((len(steps), len(references)), np.nan)
    for j, t in enumerate(references):
        pos = np.searchsorted(t.steps, steps)
        hit = pos < len(t.steps)
        hit[hit] = t.steps[pos[hit]] == steps[hit]
        ref[hit, j] = t.values[pos[hit]]
    ref[~np.isfinite(ref)] = np.nan  # a seed's NaN/inf leaves the band at that step
    ok = np.isfinite(ref).any(axis=1)
    w, half = config.window, config.window // 2 + 1
    smooth = _rolling(ref, w, "median", half)
    with _quiet():
        center = np.nanmedian(smooth, axis=1)
        resid = np.abs(ref - smooth)
        pooled = np.nanmedian(resid, axis=1)
        pooled_mean = np.nanmean(resid, axis=1)
        noise = _MAD * _rolling(pooled, config.scale_window, "median")[:, 0]
        fallback = _MEDIAN_SE * _rolling(pooled_mean, config.scale_window, "mean")[:, 0]
        noise = np.where(noise > 0, noise, fallback)  # quantised metrics: MAD 0, mean abs deviation not
        n_seeds = np.isfinite(smooth).sum(axis=1)
        spread = _MAD * np.nanmedian(np.abs(smooth - center[:, None]), axis=1)
        spread = np.where(n_seeds >= 2, spread, 0.0)
        spread = _rolling(spread, config.scale_window, "median")[:, 0]
        n_ref = _rolling(np.isfinite(ref).astype(float), w, "sum").mean(axis=1) if ref.shape[1] else None
    return _RefPart(ref, ok, smooth, center, noise, spread, n_seeds, n_ref)


def _band(rp: _RefPart, steps: np.ndarray, cand: np.ndarray, config: DivergenceConfig) -> Band:
    w, half = config.window, config.window // 2 + 1
    center, noise, n_seeds = rp.center, rp.noise, rp.n_seeds
    with _quiet():
        cand_f = np.where(np.isfinite(cand), cand, np.nan)
        cand_smooth = _rolling(cand_f, w, "median", half)[:, 0]
        n_cand = _rolling(np.isfinite(cand_f).astype(float), w, "sum")[:, 0]
        n_ref = rp.n_ref if rp.n_ref is not None else n_cand
        se = _MEDIAN_SE * noise * np.sqrt(1 / np.maximum(n_cand, 1) + 1 / np.maximum(n_ref * n_seeds, 1))
        # The seeds' smoothed curves differ by their smoothing noise (already in `se`) and by how
        # seeds wander; keep only the latter, for a new seed and for the centre's own error.
        wander2 = np.maximum(rp.spread**2 - (_MEDIAN_SE * noise) ** 2 / np.maximum(n_ref, 1), 0.0)
        spread = np.sqrt(wander2 * (1 + 1.0 / np.maximum(n_seeds, 1)))
        half_width = config.k * np.sqrt(se**2 + spread**2)
        half_width = np.maximum(half_width, np.maximum(config.min_delta, config.rel_delta * np.abs(center)))
        half_width = np.maximum(half_width, 1e-12 * np.maximum(1.0, np.abs(center)))
        # Never narrower than the seeds themselves: a candidate as far out as the farthest seed, plus
        # the noise of comparing two rolling medians, is still a seed (few seeds underestimate spread).
        se_one = _MEDIAN_SE * noise * np.sqrt(1 / np.maximum(n_cand, 1) + 1 / np.maximum(n_ref, 1))
        upper = np.fmax(center + half_width, np.nanmax(rp.smooth, axis=1) + config.k * se_one)
        lower = np.fmin(center - half_width, np.nanmin(rp.smooth, axis=1) - config.k * se_one)
    return Band(steps, center, lower, upper, noise, cand_smooth)


@contextmanager
def _quiet():
    """numpy warns on all-NaN slices (steps no reference logged); those steps are simply not compared."""
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def detect_divergence(references: Trace | Sequence[Trace], candidate: Trace,
                      config: DivergenceConfig = DivergenceConfig()) -> Divergence:
    """Compare `candidate` with the reference run (or seeds) for one metric; see the module docstring."""
    refs = [references] if isinstance(references, Trace) else list(references)
    if not refs:
        raise ValueError("detect_divergence needs at least one reference trace")
    band, cand, ref_ok = compute_band(refs, candidate, config)
    n = len(band.steps)
    cand_bad = ~np.isfinite(cand) & ref_ok
    first_bad = int(band.steps[np.flatnonzero(cand_bad)[0]]) if cand_bad.any() else None
    compared = ref_ok & np.isfinite(band.candidate) & np.isfinite(band.center)
    above = compared & (band.candidate > band.upper)
    below = compared & (band.candidate < band.lower)

    with _quiet():
        resid = np.abs(np.where(np.isfinite(cand), cand, np.nan) - band.candidate)
        cand_noise = _MAD * _rolling(resid, 2 * config.window + 1, "median", config.window)[:, 0]
        noisy = compared & (cand_noise > config.var_ratio * band.noise) & (band.noise > 0)

    found = []
    for kind, mask in (("level", above), ("level", below), ("variance", noisy), ("nonfinite", cand_bad)):
        i = _first_run(mask, min(config.persist, n))
        if i is not None:
            found.append((i, kind, mask))
    if not found:
        return Divergence(candidate.key, None, None, None, float("nan"), float("nan"), first_bad, int(compared.sum()),
                          config.min_steps)
    i0, kind, mask = min(found, key=lambda f: f[0])
    if kind == "level" and i0 > 0:
        i = _refine_onset(cand - band.center, i0, config.window)
    elif kind == "level":
        # Out from the first compared step: there is no "before" to fit a split to (a fit would move the
        # onset to wherever the gap grows most), and the centred median already sees later steps. The
        # onset is the first raw point outside the band on the departure's side.
        side = cand > band.upper if mask is above else cand < band.lower
        hits = np.flatnonzero(side[: config.window + 1])
        i = int(hits[0]) if len(hits) else i0
    else:
        i = i0
    back = _first_run(~mask[i0:], config.persist)  # back inside for `persist` steps: the departure ended
    j = n if back is None else i0 + back
    end_step = None if back is None else int(band.steps[j - 1])
    seg = slice(i, j)
    with _quiet():
        delta = float(np.nanmedian((band.candidate - band.center)[seg])) if kind != "nonfinite" else float("nan")
        noise = float(np.nanmedian(band.noise[seg]))
    delta_sigma = delta / noise if noise > 0 and np.isfinite(delta) else float("nan")
    return Divergence(candidate.key, int(band.steps[i]), kind, end_step, delta, delta_sigma, first_bad,
                      int(compared.sum()), config.min_steps)


def _refine_onset(dev: np.ndarray, i: int, window: int) -> int:
    """The split of the raw deviation near `i` that best separates before from after (a CUSUM step
    fit over +-`window` steps): a centred median can cross the band up to half a window early or late."""
    lo, hi = max(0, i - window), min(len(dev), i + window + 1)
    seg = dev[lo:hi]
    ok = np.isfinite(seg)
    if ok.sum() < 4:
        return i
    idx, x = np.flatnonzero(ok), seg[ok]
    n = len(x)
    csum = np.cumsum(x)
    k = np.arange(1, n)  # split before element k
    left, right = csum[:-1] / k, (csum[-1] - csum[:-1]) / (n - k)
    score = np.abs(right - left) * np.sqrt(k * (n - k) / n)
    return lo + int(idx[1:][np.argmax(score)])


DIVERGENCE_COLUMNS = ["run_id", "key", "onset_step", "kind", "end_step", "delta", "delta_sigma",
                      "first_nonfinite_step", "steps_compared", "steps_needed", "status"]


def compare_runs(histories: Histories, reference_ids: Sequence[str], candidate_ids: Sequence[str],
                 keys: Sequence[str] | None = None, config: DivergenceConfig = DivergenceConfig()
                 ) -> dict[str, dict[str, Divergence]]:
    """`{key: {candidate: Divergence}}`: every candidate against the references' band, per metric.

    The one candidate x metric loop of the dashboard, the report and the watcher. A metric is compared
    where at least one reference and the candidate logged points of it; `keys` default to every metric
    the histories hold."""
    keys = list(keys) if keys is not None else list(histories.keys)
    pairs, bands = [], {}
    for key in keys:
        refs = [t for t in histories.for_key(key, reference_ids).values() if len(t)]
        if not refs:
            continue
        bands[key] = refs
        pairs += [(cand, key) for cand in candidate_ids
                  if (t := histories.get(cand, key)) is not None and len(t)]

    def detect(pair: tuple[str, str]) -> Divergence:
        cand, key = pair
        return detect_divergence(bands[key], histories.get(cand, key), config)

    # Threads: most of the time is in pandas' rolling medians and numpy's partitions, which release the GIL.
    workers = max(1, min(8, os.cpu_count() or 1, len(pairs)))
    # `_quiet` saves and restores the process-wide warning filters, which threads entering and leaving
    # it at once restore out of order: quiet here too, so that every state they restore is quiet.
    with _quiet(), ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rldiag-divergence") as pool:
        found = list(pool.map(detect, pairs))
    out: dict[str, dict[str, Divergence]] = {}
    for (cand, key), d in zip(pairs, found):
        out.setdefault(key, {})[cand] = d
    return out


def divergence_frame(divergences: dict[str, dict[str, Divergence]]) -> pd.DataFrame:
    """`compare_runs`' result as one row per (candidate, metric), columns DIVERGENCE_COLUMNS (None stays None)."""
    rows = [{"run_id": cand, **{f: getattr(d, f) for f in DIVERGENCE_COLUMNS[1:]}}
            for key, by_cand in divergences.items() for cand, d in by_cand.items()]
    return pd.DataFrame(rows, columns=DIVERGENCE_COLUMNS, dtype=object)


# ---- per candidate: what the comparison says, for a headline ---------------------------------------
NONFINITE, NOT_COMPARED = "nonfinite", "not_compared"  # CandidateSummary.status, besides Divergence's


@dataclass(frozen=True)
class CandidateSummary:
    """What the comparison says about one candidate (`summarize`): non-finite gradients first, then
    the metrics it left the band on, then how much the rest rests on."""

    run_id: str
    steps_needed: int  # DivergenceConfig.min_steps
    nonfinite_steps: tuple[int, ...]  # steps with non-finite gradients (rldiag.app.analysis.nan_events.bad_steps)
    departures: tuple[Divergence, ...]  # the metrics it left the band on, earliest onset first
    within: tuple[Divergence, ...]  # compared on enough steps, no departure
    thin: tuple[Divergence, ...]  # no departure on 1 to steps_needed - 1 compared steps
    not_compared: tuple[str, ...]  # keys it logged with 0 steps compared, or that no reference logged
    no_reference: tuple[str, ...]  # those of not_compared that no reference logged
    last_logged: dict[str, int]  # key -> its last step, for metrics that stop while the run goes on

    @property
    def first_nonfinite_step(self) -> int | None:
        return self.nonfinite_steps[0] if self.nonfinite_steps else None

    @property
    def first(self) -> Divergence | None:
        """The earliest departure, or None."""
        return self.departures[0] if self.departures else None

    @property
    def status(self) -> str:
        """NONFINITE (non-finite gradients, whatever the bands say), DIVERGED, WITHIN (no departure on
        at least one metric compared on enough steps), NOT_ENOUGH_STEPS (no metric compared on enough
        steps) or NOT_COMPARED (no metric compared at all)."""
        if self.nonfinite_steps:
            return NONFINITE
        if self.departures:
            return DIVERGED
        if self.within:
            return WITHIN
        return NOT_ENOUGH_STEPS if self.thin else NOT_COMPARED

    @property
    def clean(self) -> bool:
        """Within the band on every metric it logged, each on enough steps, with finite gradients."""
        return self.status == WITHIN and not self.thin and not self.not_compared


def last_logged(histories: Histories, run_id: str, keys: Sequence[str]) -> dict[str, int]:
    """`{key: last step}` for those of `keys` that `run_id` stops logging while the run goes on (TRL
    drops kl and entropy after a NaN step): another of its loaded metrics was logged more than two of
    this metric's own logging intervals later, so a metric logged every 10th step is not "stopped" 5
    steps before the end, nor one a live run's writer has not flushed yet."""
    from rldiag.collectors.keys import canonical_key

    traces = {k: t for (r, k), t in histories.traces.items() if r == run_id and len(t)}
    if not traces:
        return {}
    end = max(t.last_step for t in traces.values())
    out = {}
    for key in keys:
        t = traces.get(canonical_key(key))
        if t is None:
            continue
        stride = max(1, int(np.median(np.diff(t.steps)))) if len(t) > 1 else 1
        if end - t.last_step > 2 * stride:
            out[key] = t.last_step
    return out


def summarize(divergences: dict[str, dict[str, Divergence]], histories: Histories, reference_ids: Sequence[str],
              candidate_ids: Sequence[str], keys: Sequence[str] | None = None,
              config: DivergenceConfig = DivergenceConfig()) -> list[CandidateSummary]:
    """Per candidate (in order), `compare_runs`' result for it as a `CandidateSummary`, with its
    non-finite gradient steps from `histories` (load grad/norm and grad/finite). `keys`: the metrics
    asked for (default: every metric the histories hold); those a candidate did not log are left out,
    those it logged that no reference did are "not compared". `config`: as compare_runs ran, where no
    divergence says it."""
    from rldiag.app.analysis.nan_events import bad_steps

    keys = list(dict.fromkeys(keys)) if keys is not None else list(histories.keys)
    found = [d for by_cand in divergences.values() for d in by_cand.values()]
    needed = found[0].steps_needed if found else config.min_steps  # as the detector ran
    out = []
    for cand in candidate_ids:
        mine = [(k, divergences[k][cand]) for k in keys if cand in divergences.get(k, {})]
        logged = [k for k in keys if (t := histories.get(cand, k)) is not None and len(t)]
        no_ref = tuple(k for k in logged if cand not in divergences.get(k, {})
                       and not any(len(t) for t in histories.for_key(k, reference_ids).values()))
        by = {s: [(k, d) for k, d in mine if d.status == s] for s in (DIVERGED, WITHIN, NOT_ENOUGH_STEPS)}
        departures = tuple(sorted((d for _, d in by[DIVERGED]), key=lambda d: d.onset_step))
        zero = tuple(k for k, d in by[NOT_ENOUGH_STEPS] if d.steps_compared == 0)
        out.append(CandidateSummary(
            cand, needed, tuple(b.step for b in bad_steps(histories, cand)), departures,
            tuple(d for _, d in by[WITHIN]), tuple(d for _, d in by[NOT_ENOUGH_STEPS] if d.steps_compared > 0),
            zero + no_ref, no_ref, last_logged(histories, cand, keys)))
    return out
