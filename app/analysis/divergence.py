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
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from rldiag.app.analysis.detector import (
    abs_diffs,
    candidate_scale,
    dequantise,
    detectable_shift,
    finite_values,
    quiet,
    reference_model,
    rolling,
    scan,
    spacing,
    transform,
    zero_indicator,
)
from rldiag.app.analysis.onsets import came_back
from rldiag.app.data.trace import Trace
from rldiag.collectors import keys as K

if TYPE_CHECKING:
    from rldiag.app.data.histories import Histories

_quiet = quiet  # compare_runs' threads (below) and older callers
DETECTOR_ENV = "RLDIAG_DETECTOR"  # KEY=VALUE options, space-separated: what `--detector` sets for every reader


@dataclass(frozen=True)
class DivergenceConfig:
    """The detector's options (one object for the dashboard, the report and the watcher; the CLI's
    `--divergence KEY=VALUE` sets them). Defaults measured on `bench.divergence_rl` (README)."""

    window: int = 9  # centre: each reference seed's centred rolling median, in steps (odd)
    k: float = 5.0  # bar of the longest trailing median, in sd of its no-change difference from the centre
    k_per_halving: float = 0.25  # the bar rises by this for each halving of the window (tested more often)
    windows: tuple[int, ...] = (11, 21, 41, 81, 129)  # trailing medians tested, in compared steps
    change_windows: tuple[tuple[int, int], ...] = ((11, 33), (21, 65))  # (recent, before): the candidate vs its own past
    k_change: float = 7.5  # bar of a change, in sd of (recent median - the one before) under no change
    k_change_loo: float = 6.5  # ... with 2+ references, whose leave-one-out scores raise it where they reach more
    detrend_window: int = 65  # steps of the wide smooth the noise is measured around
    seed_spread: float = 0.4  # prior seed-to-seed spread, in noise sd (all that 1 or 2 seeds can give)
    seed_spread_weight: float = 1.0  # the prior counts as this many seeds beside the references' estimate
    wander_span: int = 8193  # steps of the trend each reference's own slow wander is measured around (0: not measured)
    calibration_margin: float = 1.1  # a window's bar >= this x the largest value the references reach on it
    var_ratio: float = 2.5  # candidate / reference step-to-step noise of a variance departure (at least: see var_bar)
    var_window: int = 31  # trailing steps over which the candidate's noise is measured
    var_persist: int = 9  # steps in a row it must be so: clustered spikes lift the scale for a few steps (README)
    nonfinite_persist: int = 3  # non-finite steps in a row that count where the references go non-finite too
    zero_seed_spread: float = 0.1  # two-part comparison: prior seed-to-seed spread of the zero rate, in sd of one step's 0/1
    impulse_clip: float = 10.0  # innovations beyond this many robust sd: impulses, echo out (0: off; clean_impulses)
    alpha: float = 0.001  # false-alarm probability per candidate and metric over the run that sets the bars (0: fixed bars)
    tail_points: int = 50_000  # the references' noise simulated over this many points for the bars' tails (0: normal; tail_sim)
    min_delta: float = 0.0  # a departure must exceed this, in metric units
    rel_delta: float = 0.0  # ... and this fraction of the reference's level

    def __post_init__(self):
        if self.window < 1 or self.window % 2 == 0:
            raise ValueError(f"window={self.window}: use an odd number of steps >= 1, e.g. 9")
        if not self.windows or min(self.windows) < 3 or list(self.windows) != sorted(self.windows):
            raise ValueError(f"windows={self.windows}: use ascending window lengths of 3 steps or more, e.g. (5, 9, 17)")
        if self.k <= 0 or self.k_change <= 0 or self.k_change_loo <= 0 or self.detrend_window < 3 or self.var_ratio <= 1 or self.var_window < 5:
            raise ValueError(f"invalid {self}: need k, k_change and k_change_loo > 0, detrend_window >= 3, var_ratio > 1, var_window >= 5")
        if (self.nonfinite_persist < 1 or self.seed_spread < 0 or self.calibration_margin < 1 or self.var_persist < 1
                or self.zero_seed_spread < 0):
            raise ValueError(f"invalid {self}: need nonfinite_persist >= 1, seed_spread >= 0, calibration_margin >= 1, "
                             "var_persist >= 1, zero_seed_spread >= 0")
        if not 0 <= self.alpha < 1:
            raise ValueError(f"alpha={self.alpha}: use a false-alarm probability in [0, 1), e.g. 0.001 (0: the fixed bars)")
        if not self.impulse_clip >= 0:
            raise ValueError(f"impulse_clip={self.impulse_clip}: use 0 (off) or a number of innovation sd > 0, e.g. 10")
        if self.tail_points < 0:
            raise ValueError(f"tail_points={self.tail_points}: use 0 (normal noise's ratio alone) or a number of "
                             f"simulated points, e.g. 50000")

    @property
    def min_steps(self) -> int:
        """Compared steps a candidate needs before staying inside says anything: the shortest window
        twice (a stretch at parity, then one outside it). Fewer, and no departure: "not enough steps"."""
        return 2 * self.windows[0]

    @classmethod
    def from_env(cls) -> DivergenceConfig:
        """The options `rldiag report|watch|app --detector KEY=VALUE` set ($RLDIAG_DETECTOR), else the defaults."""
        raw = os.environ.get(DETECTOR_ENV, "").split()
        try:
            return cls.from_options(raw)
        except ValueError as e:
            raise ValueError(f"${DETECTOR_ENV}: {e}") from None

    @classmethod
    def from_options(cls, options: Sequence[str]) -> DivergenceConfig:
        """From `KEY=VALUE` strings (the CLI's `--divergence`), e.g. `k=6` or `windows=5,9,17`."""
        kinds = {f.name: f for f in fields(cls)}
        values: dict = {}
        for item in options:
            key, sep, raw = item.partition("=")
            key = key.strip().replace("-", "_")
            if not sep or key not in kinds:
                raise ValueError(f"divergence option {item!r}: use KEY=VALUE with KEY one of {', '.join(kinds)}")
            default = getattr(cls(), key)
            try:
                if key == "change_windows":
                    values[key] = tuple(tuple(int(x) for x in pair.split(":")) for pair in raw.split(",") if pair.strip())
                elif isinstance(default, tuple):
                    values[key] = tuple(int(x) for x in raw.split(",") if x.strip())
                else:
                    values[key] = type(default)(raw)
            except ValueError:
                raise ValueError(f"divergence option {item!r}: {key} takes a {type(default).__name__}, "
                                 f"e.g. {key}={default if not isinstance(default, tuple) else ','.join(map(str, default))}") from None
        return cls(**values)


@dataclass(frozen=True)
class Band:
    """The band one trailing-median test uses on the compared steps (for a chart to shade) and the
    candidate's trailing median it compares with it: that median outside the band is a level departure."""

    steps: np.ndarray
    center: np.ndarray
    lower: np.ndarray  # `window`'s bar (and the min_delta/rel_delta floor) around the centre, metric units
    upper: np.ndarray
    noise: np.ndarray  # the references' point noise (one sd, compared scale), per step
    candidate: np.ndarray  # the candidate's trailing median over `window` compared points, same steps
    window: int = 0  # the trailing median's length, in compared points


DIVERGED, WITHIN, NOT_ENOUGH_STEPS = "diverged", "within", "not_enough_steps"  # Divergence.status


@dataclass(frozen=True)
class Departure:
    """One stretch outside the references' noise, in metric units."""

    kind: str  # "level", "variance", "zero_rate" (how often it is exactly 0: two-part comparison) or "nonfinite"
    onset_step: int  # first step, placed after the fact
    alert_step: int  # the step at which a causal scan (a watcher polling every step) first reports it
    end_step: int | None  # last step; None while it lasts to the candidate's end
    candidate: float  # the candidate's median over it (NaN for nonfinite; zero_rate: its fraction of exact zeros)
    reference: float  # the reference centre's median over it (zero_rate: the references' fraction)
    delta: float  # median of (candidate - centre) over it, metric units
    delta_sigma: float  # the residual in sd of the references' point noise (log sd for log-compared metrics)

    @property
    def lasting(self) -> bool:
        """It lasts to the candidate's last step (a transient came back: `end_step`)."""
        return self.end_step is None

    @property
    def weight(self) -> float:
        """How far out it is, roughly in multiples of the default bar (a level's 5 sd, a variance's 2.5x
        noise): the order a headline ranks departures of different metrics by. Non-finite: inf."""
        if self.kind == "nonfinite":
            return float("inf")
        x = abs(self.delta_sigma) if self.delta_sigma == self.delta_sigma else 0.0
        if self.kind == "variance":
            return x / DivergenceConfig.var_ratio
        if self.kind == "zero_rate":  # its size is a difference of rates, not sd: counted as at the bar
            return 1.0
        return x / DivergenceConfig.k


@dataclass(frozen=True)
class Divergence:
    key: str
    onset_step: int | None  # first step of the first departure; None: the candidate stays inside
    kind: str | None  # "level", "variance", "zero_rate" or "nonfinite"
    end_step: int | None  # last step of the first departure; None while it lasts to the candidate's end
    delta: float  # median of (candidate - centre) over the first departure, metric units (NaN if none)
    delta_sigma: float  # the same in units of the references' point noise
    first_nonfinite_step: int | None  # the candidate's first NaN/inf where the reference is finite
    steps_compared: int
    steps_needed: int = DivergenceConfig().min_steps  # the config's min_steps (in points: more steps where zeros are left out)
    alert_step: int | None = None  # when a watcher polling every step first reports the first departure
    departures: tuple[Departure, ...] = field(default=())  # every departure, in order of onset
    detectable: float = float("nan")  # smallest lasting shift (metric units), either way from where the candidate sits, a test that fills flags
    candidate_level: float = float("nan")  # the candidate's median over the first departure, metric units
    reference_level: float = float("nan")  # the reference centre's median over it
    # the candidate's logged steps after the references' last step (not compared: no band there), and that step
    steps_after_references: int = 0
    references_end_step: int | None = None

    @property
    def diverged(self) -> bool:
        return self.onset_step is not None

    @property
    def first(self) -> Departure | None:
        return self.departures[0] if self.departures else None

    @property
    def lead(self) -> Departure | None:
        """The departure a headline names for this metric: the one that lasts to the end if any (always the
        last), else the largest (`Departure.weight`), the earliest of equals. None without a departure."""
        if not self.departures:  # one built from a table row: its first departure's fields
            if self.onset_step is None:
                return None
            return Departure(self.kind or "level", self.onset_step,
                             self.alert_step if self.alert_step is not None else self.onset_step, self.end_step,
                             self.candidate_level, self.reference_level, self.delta, self.delta_sigma)
        if self.departures[-1].lasting:
            return self.departures[-1]
        return max(self.departures, key=lambda d: (d.weight, -d.alert_step))

    @property
    def status(self) -> str:
        """DIVERGED (a departure was found), NOT_ENOUGH_STEPS (none, on fewer compared steps than the
        detector needs: 0 means nothing was compared) or WITHIN (none, on enough steps)."""
        if self.onset_step is not None:
            return DIVERGED
        return NOT_ENOUGH_STEPS if self.steps_compared < self.steps_needed else WITHIN

    @property
    def evidence(self) -> str:
        """The status in words: "diverged", "within the band", "not enough steps (8 compared, 10
        needed)" or "not compared (0 steps)"."""
        status = self.status
        if status == DIVERGED:
            return "diverged"
        if status == WITHIN:
            past = (f" to step {self.references_end_step} (the references end there: {self._uncompared_tail()})"
                    if self.steps_after_references else "")
            if math.isfinite(self.detectable) and self.detectable > 0 and not is_flag(self.key):
                return f"within the band{past} (a lasting shift under {self.detectable:.3g} would not show)"
            return f"within the band{past}"
        after = (f"; the references end at step {self.references_end_step}: {self._uncompared_tail()}"
                 if self.steps_after_references else "")
        if self.steps_compared == 0:
            return f"not compared (0 steps{after})"
        return f"not enough steps ({self.steps_compared} compared, {self.steps_needed} needed{after})"

    @property
    def size(self) -> str:
        """The first departure's size for a table, in metric units and relative to the reference, no sd
        (a column of its own: `sigma_cell`): "1.263 vs 1 (+26%)", "exactly 0 at 62% of steps vs 30%",
        "noise x3.2 the reference's", "non-finite where the references are finite"; "" with none."""
        if self.kind is None:
            return ""
        if self.kind == "nonfinite":
            return "non-finite where the references are finite"
        if self.kind == "zero_rate":
            return zero_rate_text(self.candidate_level, self.reference_level)
        if self.kind == "variance":
            ratio = self.first.delta_sigma if self.first is not None else float("nan")
            return f"noise x{ratio:.1f} the reference's" if math.isfinite(ratio) else "noise larger than the reference's"
        return size_text(self.candidate_level, self.reference_level)

    def _uncompared_tail(self) -> str:
        n = self.steps_after_references
        return f"{n} later step{'' if n == 1 else 's'} not compared"


def reference_note(n_references: int, config: DivergenceConfig = DivergenceConfig()) -> str:
    """What a band of one reference run cannot tell ("" for 2 or more): how far seeds differ."""
    if n_references != 1:
        return ""
    wander = (f", plus the slow wander the reference itself shows where it has {config.wander_span:,} steps or more"
              if config.wander_span > 0 else "")
    return (f"One reference run: how far seeds differ cannot be measured, so the band assumes "
            f"{config.seed_spread:g} noise sd (seed_spread) for the offset between seeds{wander}; a slow level "
            "departure may be seed-to-seed variation. Two or more reference seeds measure it.")


# 0/1 flags: any change of one shows, so no "lasting shift under 2.98e-07 on grad/finite would not show"
FLAGS = frozenset({K.GRAD_FINITE, K.GRAD_FOUND, K.GRAD_SKIPPED, K.GRAD_SCALER_OVERFLOW})


def is_flag(key: str) -> bool:
    return K.canonical_key(key) in FLAGS


def detectable_text(verdicts: Sequence[Divergence]) -> str:
    """What "within" verdicts could have missed, the largest per metric: "a lasting shift under 0.05 on
    loss, 0.3 on reward/mean would not show" ("" when none says)."""
    worst: dict[str, float] = {}
    for d in verdicts:
        if d.status == WITHIN and math.isfinite(d.detectable) and d.detectable > 0 and not is_flag(d.key):
            worst[d.key] = max(worst.get(d.key, 0.0), d.detectable)
    if not worst:
        return ""
    return "a lasting shift under " + ", ".join(f"{v:.3g} on {k}" for k, v in worst.items()) + " would not show"


def sigma_text(x: float) -> str:
    """A residual in noise sd for display: bounded (references that agree to 1e-7 make any gap huge)."""
    if not math.isfinite(x):
        return ""
    if abs(x) >= 1000:
        return f"{'>' if x > 0 else '<-'}1000 sd"
    return f"{x:+.1f} sd"


def sigma_cell(x) -> str:
    """A table's sigma cell, bounded as `sigma_text`: "+8.2", ">+1000" (also a reference with no noise,
    where it is inf), "<-1000"; "-" where it is undefined (None, NaN: no departure, a non-finite,
    zero-rate or variance one)."""
    if x is None or not isinstance(x, (int, float, np.floating)) or math.isnan(x):
        return "-"
    if abs(x) >= 1000:
        return ">+1000" if x > 0 else "<-1000"
    return f"{x:+.1f}"


def size_text(candidate: float, reference: float, delta_sigma: float = float("nan")) -> str:
    """"1.263 vs 1 (+26%, +8.0 sd)": metric units first, relative to the reference, sd last and bounded
    (left out where `delta_sigma` is NaN)."""
    if not (math.isfinite(candidate) and math.isfinite(reference)):
        return sigma_text(delta_sigma)
    rel = (candidate - reference) / abs(reference) if reference else float("nan")
    extra = [f"{rel:+.0%}"] * (math.isfinite(rel) and abs(rel) < 100) + [sigma_text(delta_sigma)] * bool(sigma_text(delta_sigma))
    return f"{candidate:.4g} vs {reference:.4g}" + (f" ({', '.join(extra)})" if extra else "")


def zero_rate_text(candidate: float, reference: float) -> str:
    """A zero_rate departure's size: "exactly 0 at 62% of steps vs 30%"."""
    return f"exactly 0 at {candidate:.0%} of steps vs {reference:.0%}"


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
        stretches = scan(r, cand_bad, cand_scale, model.noise, config, abs_diffs(ct, carry=is_zero),
                         zero_ind, zeros, zeros.rate[pos] if zeros is not None else None)
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
    bar = detectable_shift(r, model.noise, config)
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


DIVERGENCE_COLUMNS = ["run_id", "key", "onset_step", "kind", "end_step", "delta", "delta_sigma",
                      "first_nonfinite_step", "steps_compared", "steps_needed", "alert_step", "detectable",
                      "candidate_level", "reference_level", "steps_after_references", "references_end_step",
                      "status", "size"]
DERIVED_COLUMNS = ("status", "size")  # properties of a Divergence, not fields: a row rebuilds one without them


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
# The metrics a reader sees first: the Compare page charts these by default, and a headline prefers them
# among lasting departures, so that a report comparing every logged metric names the page's metric.
HEADLINE_METRICS: tuple[str, ...] = (K.RATIO_MEAN, K.CLIP_RATE, K.CLIP_ACTIVE_RATE, K.KL_NEW_OLD, K.KL_REF, K.ENTROPY,
                                     K.REWARD_MEAN, K.MISMATCH_LOGPROB_MEAN, K.GRAD_NORM, K.LOSS)


@dataclass(frozen=True)
class CandidateSummary:
    """What the comparison says about one candidate (`summarize`): non-finite gradients first, then
    the metrics it left the band on, then how much the rest rests on."""

    run_id: str
    steps_needed: int  # DivergenceConfig.min_steps (a metric compared in two parts needs more: its own steps_needed)
    nonfinite_steps: tuple[int, ...]  # steps with non-finite gradients (rldiag.app.analysis.nan_events.bad_steps)
    departures: tuple[Divergence, ...]  # the metrics it left the band on, earliest onset first
    within: tuple[Divergence, ...]  # compared on enough steps, no departure
    thin: tuple[Divergence, ...]  # no departure on 1 to steps_needed - 1 compared steps
    not_compared: tuple[str, ...]  # keys it logged with 0 steps compared, or that no reference logged
    no_reference: tuple[str, ...]  # those of not_compared that no reference logged
    last_logged: dict[str, int]  # key -> its last step, for metrics that stop while the run goes on
    # its non-finite steps are likely fp16 loss-scaler overflows (`step_events.with_overflow_hints`: an fp16
    # run rldiag did not watch); they stay non-finite steps, the headline says it beside them
    likely_overflows: bool = False
    # key -> the references' last step, for metrics it logged past it (not compared there)
    past_references: dict[str, int] = field(default_factory=dict)
    # key -> the step every point was logged at, for metrics that it or a reference logged with no step
    # (`Trace.logged_at`): compared in logging order, which is a step only if each was logged once a step
    by_order: dict[str, int] = field(default_factory=dict)
    # steps where it logged batch/valid_tokens 0 (`nan_events.empty_steps`): every token masked, its policy
    # metrics there an empty batch's placeholders (ratio 1, KL 0), which read as a perfect step
    empty_steps: tuple[int, ...] = ()
    empty_truncated: bool = False  # some of them found as TRL's every-completion-truncated, masked (nan_events)
    # key -> (its last step, the references' last step), for metrics it stops logging before the references do
    stops_short: dict[str, tuple[int, int]] = field(default_factory=dict)
    never_logged: tuple[str, ...] = ()  # metrics asked for that a reference logged and it did not
    unchecked: tuple[int, ...] = ()  # steps with grad/found 0: no gradient found, so finite or not is unknown
    checked_steps: int = 0  # steps with a grad/found value (0: it logged no grad/found)

    @property
    def first_nonfinite_step(self) -> int | None:
        return self.nonfinite_steps[0] if self.nonfinite_steps else None

    @property
    def first(self) -> Divergence | None:
        """The metric every headline leads with (`ranked`'s first), or None: the report, the Compare page and
        the verdict rows all take it from here."""
        ranked = self.ranked
        return ranked[0] if ranked else None

    @property
    def ranked(self) -> tuple[Divergence, ...]:
        """The departed metrics, what a headline leads with first: a metric still out at the end before one
        that came back (a warm-up burst that ended never leads a lasting drift), then one of
        HEADLINE_METRICS (the Compare page's), then the larger (`Departure.weight` of its
        `Divergence.lead`), the earlier alert, the canonical metric order (so that the order the keys
        were asked in never changes the headline)."""
        from rldiag.collectors.keys import CANONICAL_METRICS

        order = {k: i for i, k in enumerate(CANONICAL_METRICS)}

        def rank(d: Divergence):
            lead = d.lead
            return (not lead.lasting, d.key not in HEADLINE_METRICS, -lead.weight, lead.alert_step,
                    order.get(d.key, len(order)), d.key)

        return tuple(sorted((d for d in self.departures if d.lead is not None), key=rank))

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
        """Within the band on every metric it logged, each on enough steps and to its last step, with
        finite gradients."""
        return (self.status == WITHIN and not self.thin and not self.not_compared and not self.past_references
                and not self.by_order and not self.empty_steps and not self.stops_short and not self.never_logged
                and not self.unchecked)


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
    non-finite gradient steps from `histories` (load grad/norm and grad/finite) and its steps of no valid
    tokens (load batch/valid_tokens). `keys`: the metrics
    asked for (default: every metric the histories hold); those a candidate did not log are left out,
    those it logged that no reference did are "not compared". `config`: as compare_runs ran, where no
    divergence says it."""
    from rldiag.app.analysis.nan_events import bad_steps, empty_steps, unchecked_steps
    from rldiag.collectors.keys import GRAD_FOUND

    keys = list(dict.fromkeys(keys)) if keys is not None else list(histories.keys)
    found = [d for by_cand in divergences.values() for d in by_cand.values()]
    # as the detector ran: its min_steps, the fewest any metric needs (one compared in two parts needs more)
    needed = min((d.steps_needed for d in found), default=config.min_steps)
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
            zero + no_ref, no_ref, last_logged(histories, cand, keys),
            past_references={k: d.references_end_step for k, d in mine if d.steps_after_references},
            by_order=logged_by_order(histories, [cand, *reference_ids], logged),
            empty_steps=tuple(empty_steps(histories, cand)),
            stops_short=stops_short(histories, cand, reference_ids, keys),
            never_logged=tuple(k for k in keys if k not in logged and reference_ids and any(
                len(t) for t in histories.for_key(k, reference_ids).values())),
            unchecked=tuple(unchecked_steps(histories, cand)),
            checked_steps=len(histories.get(cand, GRAD_FOUND) or ())))
    return out


def stops_short(histories: Histories, run_id: str, reference_ids: Sequence[str], keys: Sequence[str]
                ) -> dict[str, tuple[int, int]]:
    """`{key: (its last step, the references' last step)}` for those of `keys` that `run_id` logged but
    stops logging before the references' last step: the steps after it were not compared."""
    out = {}
    for key in keys if reference_ids else ():  # no reference: nothing to stop short of
        t = histories.get(run_id, key)
        ends = [int(r.steps[-1]) for r in histories.for_key(key, reference_ids).values() if len(r)]
        if t is not None and len(t) and ends and int(t.steps[-1]) < max(ends):
            out[key] = (int(t.steps[-1]), max(ends))
    return out


def logged_by_order(histories: Histories, run_ids: Sequence[str], keys: Sequence[str]) -> dict[str, int]:
    """`{key: step}` for those of `keys` that one of `run_ids` logged with every point at that one step
    (`Trace.logged_at`: its steps are its logging order)."""
    out = {}
    for key in keys:
        for run in run_ids:
            t = histories.get(run, key)
            if t is not None and t.logged_at is not None:
                out[key] = t.logged_at
                break
    return out
