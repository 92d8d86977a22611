"""Where a candidate run leaves its reference: per metric, every stretch it spends outside the
references' noise, when a watcher would first know, and by how much (metric units first).

The test (`rldiag.app.analysis.detector`, whose docstring maps its parts; each part's module says why
each of its rules is there):
- centre: the median across reference seeds of each seed's centred rolling median (`window` steps);
- the candidate's residual from the centre, in the metric's units, or as logs for positive
  heavy-tailed metrics (KL, clip rate, grad norm) whose noise is symmetric there;
- trailing medians of the residual over `windows` (5 to 129 points), each against the sd it has under
  no change: the references' point noise with its autocorrelation, the centre's own error and the
  seed-to-seed spread (estimated from the seeds; a prior of `seed_spread` noise sd where fewer seeds
  tell, plus the slow wander each reference shows around its own trend on runs of `wander_span` steps
  or more); a departure is any window beyond `k` such sd (or beyond what the references' own bursts
  reach on it, if more); it ends once that window is back under half its bar for a window's length;
- also: the candidate's step-to-step noise `var_ratio` (or more) times the references' (`kind="variance"`),
  the candidate non-finite where the references are finite (`kind="nonfinite"`), and, for a metric the
  references log as exactly 0 at more than 10% of steps, how often it is 0 (`kind="zero_rate"`: its
  other values are compared as above, the zeros left out).
The scan is causal: `alert_step` is the step a watcher polling every step reports the departure at;
`onset_step` is placed after the fact (a CUSUM split, then the first point out of the band from it:
`onsets.first_out`). Considered: `ruptures` (offline change-point segmentation): it finds where one
series changes, not where one leaves another's noise, and needs a penalty per metric scale.

A candidate without a departure on fewer compared steps than `DivergenceConfig.min_steps` is "not
enough steps" (`Divergence.status`), never "within". `summarize` says per candidate what the
comparison shows, for the headlines of the report, the dashboard and `rldiag report`: non-finite
gradients first, then the first departure, then how much was compared (metrics with not enough
steps, not compared, or no longer logged).

Where its parts live (each imports nothing from here; all are re-exported here): `divergence_config`
(`DivergenceConfig`, $RLDIAG_DETECTOR), `divergence_results` (`Divergence`, `Departure`, `Band`, the
statuses, DIVERGENCE_COLUMNS and their words), `divergence_summary` (`summarize`, `CandidateSummary`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from rldiag.app.analysis.detector import (
    abs_diffs,
    candidate_scale,
    dequantise,
    detectable_shift,
    finite_values,
    level_residual,
    quiet,
    reference_model,
    rolling,
    scan,
    spacing,
    transform,
    zero_indicator,
)
from rldiag.app.analysis.divergence_config import DETECTOR_ENV, DivergenceConfig
from rldiag.app.analysis.divergence_results import (
    DERIVED_COLUMNS,
    DIVERGED,
    DIVERGENCE_COLUMNS,
    FLAGS,
    NOT_ENOUGH_STEPS,
    WITHIN,
    Band,
    Departure,
    Divergence,
    detectable_text,
    is_flag,
    reference_note,
    sigma_cell,
    sigma_text,
    size_text,
    zero_rate_text,
)
from rldiag.app.analysis.divergence_summary import (
    HEADLINE_METRICS,
    NONFINITE,
    NOT_COMPARED,
    CandidateSummary,
    last_logged,
    logged_by_order,
    stops_short,
    summarize,
)
from rldiag.app.analysis.onsets import came_back
from rldiag.app.data.trace import Trace

if TYPE_CHECKING:
    from rldiag.app.data.histories import Histories

_quiet = quiet  # compare_runs' threads (below) and older callers

# Re-exported: every name this module had before its options, result types and summary moved out
# imports from here as before.
__all__ = [
    "DERIVED_COLUMNS", "DETECTOR_ENV", "DIVERGED", "DIVERGENCE_COLUMNS", "FLAGS", "HEADLINE_METRICS", "NONFINITE",
    "NOT_COMPARED", "NOT_ENOUGH_STEPS", "WITHIN", "Band", "CandidateSummary", "Departure", "Divergence",
    "DivergenceConfig", "compare_runs", "compute_band", "detect_divergence", "detectable_text", "divergence_frame",
    "is_flag", "last_logged", "logged_by_order", "reference_note", "sigma_cell", "sigma_text", "size_text",
    "stops_short", "summarize", "zero_rate_text",
]


def _aligned(model, candidate: Trace):
    """The candidate on the reference grid: steps, values (finite or NaN), reference-finite mask, centre."""
    pos = np.searchsorted(model.steps, candidate.steps)
    hit = pos < len(model.steps)
    hit[hit] = model.steps[pos[hit]] == candidate.steps[hit]
    pos = pos[hit]
    keep = model.ref_ok[pos]  # only steps where a reference is finite are compared (a NaN there counts, elsewhere not)
    steps = candidate.steps[hit][keep]
    raw = np.asarray(candidate.values[hit][keep], float)
    return steps, raw, pos[keep]


def _at(t: Trace, steps: np.ndarray) -> Trace:
    keep = np.isin(t.steps, steps)
    return Trace(t.run_id, t.key, t.source_key, t.steps[keep], t.values[keep], t.timestamps[keep])


@functools.lru_cache(maxsize=32)
def _model_at(references: tuple[Trace, ...], steps: bytes, config: DivergenceConfig):
    """The reference model of `references` at these steps only (cached: the dashboard's refresh asks again)."""
    at = np.frombuffer(steps, np.int64)
    return reference_model(tuple(_at(t, at) for t in references), config)


def _floor(model, center_t: np.ndarray, config: DivergenceConfig) -> np.ndarray:
    """min_delta / rel_delta as a floor on |residual| in the compared scale."""
    if not (config.min_delta or config.rel_delta):
        return np.zeros(len(center_t))
    if model.noise.log:
        level = np.exp(center_t)
        return np.log1p(np.maximum(config.min_delta / np.maximum(level, 1e-300), config.rel_delta))
    return np.maximum(config.min_delta, config.rel_delta * np.abs(center_t))


def _inverse(model, x: np.ndarray) -> np.ndarray:
    return np.exp(x) if model.noise.log else x


def _residual(references: Sequence[Trace], candidate: Trace, config: DivergenceConfig):
    grid = np.unique(np.concatenate([t.steps for t in references])) if references else np.empty(0, np.int64)
    if spacing(np.searchsorted(grid, candidate.steps)) <= 1:
        model = reference_model(tuple(references), config)
    else:
        # The candidate logs more sparsely than the references (logging_steps=5 beside runs that log every
        # step): the model is built from the references at its steps alone, so that its noise, the
        # autocorrelation between its points and the step-to-step scale are those of points as far apart
        # as the candidate's. On one step's, the candidate's 5-step changes (larger under autocorrelated
        # noise) were variance departures on 10 of 40 no-change candidates of bench.divergence_rl.
        model = _model_at(tuple(references), np.asarray(candidate.steps, np.int64).tobytes(), config)
    steps, raw, pos = _aligned(model, candidate)
    center_t = model.center[pos]
    cand = finite_values(raw)
    split = model.zeros is not None
    ct = transform(dequantise(cand, steps, model.quantum, keep_zeros=model.noise.log or split), model.noise.log,
                   model.log_floor, zeros_out=split)
    with quiet():
        r = ct - center_t
        fl = _floor(model, center_t, config)
        r = np.sign(r) * np.maximum(np.abs(r) - fl, 0.0)
    return model, steps, raw, pos, cand, ct, center_t, r


def compute_band(references: Sequence[Trace], candidate: Trace, config: DivergenceConfig = DivergenceConfig(),
                 window: int | None = None) -> tuple[Band, np.ndarray, np.ndarray]:
    """The band of one trailing-median level test on the candidate's compared steps; also the
    candidate's raw values and the reference-finite mask (all True: only such steps are compared).

    `window` (one of `config.windows`; None: the longest the candidate fills) picks the test. The band is
    its bar around the centre (wider where the window is only partly filled, and by the
    min_delta/rel_delta floor), and `Band.candidate` the centre plus the trailing median of the
    candidate's residual over as many points: outside the band exactly where that test flags a level
    departure. The longest window's bar is the narrowest, the one a lasting shift crosses; the shortest's
    is 2-3 times as wide (8.6 noise sd against 3.4 on AR(0.6) references), so drawn alone it held a
    candidate the longest window flagged. Bursts (shorter windows), the change test, variance and
    non-finite departures are tested apart: not this band."""
    from rldiag.app.analysis.detector import level_residual, min_points, partial_sd, thinned_phi

    model, steps, raw, _pos, _cand, ct, center_t, _r = _residual(references, candidate, config)
    noise = model.noise
    if window is None:
        window = max([m for m in config.windows if min_points(m) <= len(steps)] or [config.windows[0]])
    if window not in config.windows:
        raise ValueError(f"window={window}: use one of the detector's windows {config.windows}")
    i = config.windows.index(window)
    with quiet():
        resid = ct - center_t
        x = level_residual(resid, noise, config)  # as the test reads it: its finite points alone if zeros are out
        own = noise.own_sd[i] if noise.own_sd else 0.0
        sd = partial_sd(x, window, thinned_phi(noise.phi, noise.fill), noise.null_sd[i], own)
        med = rolling(x, window, "median", center=False, min_periods=min_points(window))  # the test's median
        sd = np.broadcast_to(sd, x.shape)
        if len(x) != len(steps):  # back onto every compared step: a left-out zero keeps the last value
            at = np.flatnonzero(np.isfinite(resid))
            idx = np.maximum(np.searchsorted(at, np.arange(len(steps)), side="right") - 1, 0)
            med, sd = (med[idx], sd[idx]) if len(at) else (np.full(len(steps), np.nan),) * 2
        half = noise.threshold[i] * sd + _floor(model, center_t, config)
    band = Band(steps, _inverse(model, center_t), _inverse(model, center_t - half), _inverse(model, center_t + half),
                np.full(len(steps), noise.sigma), _inverse(model, center_t + med), window)
    return band, raw, np.ones(len(steps), bool)


def detect_divergence(references: Trace | Sequence[Trace], candidate: Trace,
                      config: DivergenceConfig = DivergenceConfig()) -> Divergence:
    """Compare `candidate` with the reference run (or seeds) for one metric; see the module docstring."""
    refs = [references] if isinstance(references, Trace) else list(references)
    if not refs:
        raise ValueError("detect_divergence needs at least one reference trace")
    model, steps, _raw, pos, cand, ct, center_t, r = _residual(refs, candidate, config)
    cand_bad = ~np.isfinite(cand)
    first_bad = int(steps[np.flatnonzero(cand_bad)[0]]) if cand_bad.any() else None
    # two-part comparison: the candidate's zeros are left out of the level (r is NaN there), compared by their rate
    zeros = model.zeros
    zero_ind = zero_indicator(cand) if zeros is not None else None
    is_zero = zero_ind == 1 if zero_ind is not None else None
    level_points = int(np.isfinite(r).sum())
    compared = level_points + (int(is_zero.sum()) if is_zero is not None else 0)
    # what staying inside needs: the shortest window twice, in points; where zeros are left out, the steps
    # that hold that many other values at the references' rate (a 30-step candidate 40% zeros has 18)
    needed = config.min_steps if zeros is None else int(np.ceil(config.min_steps / model.noise.fill))
    with quiet():
        cand_scale = candidate_scale(ct, config.var_window, carry=is_zero)
        # cleaned once for the scan and the smallest shift (`clean_impulses`: most of a detection's time for a
        # candidate drifting far from its references, an impulse at most of its steps)
        level = level_residual(r, model.noise, config)
        stretches = scan(r, cand_bad, cand_scale, model.noise, config, abs_diffs(ct, carry=is_zero),
                         zero_ind, zeros, zeros.rate[pos] if zeros is not None else None, level=level)
    deps = []
    center_m = _inverse(model, center_t)
    level_cand = cand if zeros is None else np.where(is_zero, np.nan, cand)  # two-part: the level is the positive values'
    gap = level_cand - center_m  # once: a noisy 100k-step run has hundreds of stretches
    sigma = model.noise.sigma
    for s in stretches:
        seg = slice(s.onset, (s.end + 1) if s.end is not None else len(steps))
        with quiet():
            ref_level = float(np.nanmedian(center_m[seg]))
            if s.kind == "nonfinite":
                c_level, delta, dsig = float("nan"), float("nan"), float("nan")
            elif s.kind == "zero_rate":
                c_level = float(np.nanmean(is_zero[seg][np.isfinite(cand[seg])]))
                ref_level = float(np.nanmean(zeros.rate[pos][seg]))
                delta, dsig = c_level - ref_level, float("nan")
            else:
                c_level = float(np.nanmedian(level_cand[seg]))
                delta = float(np.nanmedian(gap[seg]))
                if s.kind == "variance":
                    scale = cand_scale[seg]
                    ref_scale = model.noise.diff_scale
                    dsig = float(np.nanmedian(scale) / ref_scale) if ref_scale > 0 else float("nan")
                else:
                    dsig = float(np.nanmedian(r[seg]) / sigma) if sigma > 0 else float("inf") * np.sign(delta)
        end = int(steps[s.end]) if s.end is not None else None
        if s.kind == "level" and s.end is not None and (back := came_back(r, s)) != s.end:
            end = int(steps[back])  # and the size over what was out: the detector's end lags the return
            seg = slice(s.onset, back + 1)
            with quiet():
                ref_level = float(np.nanmedian(center_m[seg]))
                c_level, delta = float(np.nanmedian(level_cand[seg])), float(np.nanmedian(gap[seg]))
                dsig = float(np.nanmedian(r[seg]) / sigma) if sigma > 0 else float("inf") * np.sign(delta)
        deps.append(Departure(s.kind, int(steps[s.start]), int(steps[min(s.alert, len(steps) - 1)]), end,
                              c_level, ref_level, delta, dsig))
    # the smallest lasting shift a test that fills at this length flags, against where the candidate sits
    # (a 60-step candidate never fills the 129-step window, so its bar would understate what is missed)
    bar = detectable_shift(r, model.noise, config, level=level)
    with quiet():
        detectable = float(np.nanmedian(np.abs(_inverse(model, center_t + bar) - center_m))) if len(steps) else float("nan")
    ref_end = int(model.steps[-1]) if len(model.steps) else None
    after = int((candidate.steps > ref_end).sum()) if ref_end is not None else 0
    tail = {"steps_after_references": after, "references_end_step": ref_end if after else None}
    if not deps:
        return Divergence(candidate.key, None, None, None, float("nan"), float("nan"), first_bad, compared,
                          needed, detectable=detectable, **tail)
    d0 = deps[0]
    return Divergence(candidate.key, d0.onset_step, d0.kind, d0.end_step, d0.delta,
                      d0.delta_sigma if d0.kind == "level" else float("nan"), first_bad, compared,
                      needed, d0.alert_step, tuple(deps), detectable, d0.candidate, d0.reference, **tail)


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
