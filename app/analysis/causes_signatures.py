"""The metric signatures that likely causes are matched on, read from full histories.

Each signature has a physical threshold, not one fitted to an experiment:
- parity: at equal weights a float32 recompute matches the engine to ~1e-6 nats (FACTS-vllm-cpu.md);
  a mean |delta logprob| above `PARITY_TOL` (1e-4, far above float32 rounding, below bfloat16's ~1e-3)
  and an order of magnitude above the references' own mismatch at that step is no longer parity;
- one-signed: the signed mean of (engine - trainer) logprobs (`policy/kl_new_old_k1` where the trainer
  is at the rollout weights) against the mean absolute difference: rounding noise is symmetric (ratio
  near 0), a different distribution on one side (raw vs processed, temperature on one side only)
  shifts every sampled token the same way (ratio near 1); `ONE_SIGNED` = 0.5 splits the two;
- departure after updates: a candidate value farther from the reference seeds' range than twice that
  range (or twice their step-to-step wiggle, if larger), on `PERSIST_AFTER` consecutive steps after
  the first: seed noise gets there by chance practically never, even over 100k steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rldiag.app.analysis.is_health import IS_KEYS
from rldiag.app.data.histories import Histories
from rldiag.collectors import keys as K

PARITY_TOL = 1e-4  # nats: mean |delta logprob| beyond float32 rounding at equal weights
REF_FACTOR = 10.0  # ... and this many times the references' own mismatch at the step
ONE_SIGNED = 0.5  # |signed mean| / mean |delta| above this: the shift goes one way
PERSIST_AFTER = 3  # consecutive steps outside the seeds' range that make a departure after updates
FAR = 2.0  # ... by more than this many times the seeds' range (or their step-to-step wiggle, if larger)
# Metrics the optimizer's own departure shows on (the engine-side ones speak for the engine causes).
POLICY_KEYS = (K.ENTROPY, K.REWARD_MEAN, K.GRAD_NORM, K.KL_REF, K.LOSS, K.CLIP_RATE, K.CLIP_ACTIVE_RATE,
               K.KL_NEW_OLD)
# What the signatures read: loaders add these to what they chart.
SIGNATURE_KEYS = (K.MISMATCH_LOGPROB_MEAN, K.MISMATCH_LOGPROB_MAX, K.RATIO_MEAN, K.KL_NEW_OLD_K1, K.GRAD_FINITE,
                  K.GRAD_NORM, K.LOSS, *POLICY_KEYS, *IS_KEYS)


def _value(h: Histories, run: str, key: str, step: int) -> float | None:
    t = h.get(run, key)
    if t is None:
        return None
    i = int(np.searchsorted(t.steps, step))
    return float(t.values[i]) if i < len(t.steps) and t.steps[i] == step else None


def _on(t, steps: np.ndarray) -> np.ndarray:
    """`t`'s values at `steps` (`Trace.at`), all NaN where there is no trace."""
    return np.full(len(steps), np.nan) if t is None else t.at(steps)


def first_step(h: Histories, run: str) -> int | None:
    """The run's first logged step over every loaded metric (the step before any update)."""
    firsts = [int(t.steps[0]) for (r, _), t in h.traces.items() if r == run and len(t)]
    return min(firsts) if firsts else None


@dataclass(frozen=True)
class Parity:
    """Engine-vs-trainer logprob mismatch of a candidate at its first step and after it."""

    step: int  # the first step with a mismatch value
    before_update: bool  # that step is the run's first step (same weights on both sides)
    mean: float  # mean |delta logprob| there (nats)
    tol: float  # the parity tolerance there (PARITY_TOL or REF_FACTOR x the references')
    signed: float | None  # signed mean (engine - trainer) there, from policy/kl_new_old_k1
    ratio: float | None  # policy/ratio_mean there
    later_steps: int  # steps after the first with a mismatch value
    later_over: int  # of those, above their tolerance
    later_first_over: int | None  # the first of them above it
    later_median: float  # median mismatch over the later steps (NaN if none)

    @property
    def holds(self) -> bool:
        return math.isfinite(self.mean) and self.mean <= self.tol

    @property
    def one_signed(self) -> bool | None:
        """The step-0 mismatch shifts sampled tokens one way (None: no signed value logged)."""
        if self.signed is not None and math.isfinite(self.signed) and self.mean > 0:
            return abs(self.signed) >= ONE_SIGNED * self.mean
        if self.ratio is not None and math.isfinite(self.ratio) and self.mean > 0:
            # ratio mean = mean exp(d): |log ratio| ~ |shift| for a shift, ~ var/2 (<< mean |d|) for noise
            return abs(math.log(max(self.ratio, 1e-300))) >= ONE_SIGNED * self.mean
        return None

    @property
    def breaks_after_updates(self) -> bool:
        """Parity at the first step, lost from the first updates on (most later steps above tolerance)."""
        return self.holds and self.later_steps > 0 and 2 * self.later_over > self.later_steps


def _tol(h: Histories, refs: Sequence[str], steps: np.ndarray) -> np.ndarray:
    """The parity tolerance at each of `steps`: PARITY_TOL, or REF_FACTOR x the references' largest mismatch."""
    tol = np.full(len(steps), PARITY_TOL)
    for r in refs:
        v = _on(h.get(r, K.MISMATCH_LOGPROB_MEAN), steps)
        tol = np.fmax(tol, np.where(np.isfinite(v), REF_FACTOR * v, np.nan))
    return tol


def parity_unknown(h: Histories, run: str) -> str:
    """Why `parity` is None: no mismatch metric at all, or only others than the mean logprob difference it reads
    (verl logs only the probability difference's maximum)."""
    others = [k for k in (K.MISMATCH_LOGPROB_MAX, K.MISMATCH_PROB_MAX, K.MISMATCH_TOKEN_MULT_PROB_ERROR,
                          K.MISMATCH_LOW_PROB_SHARE) if (t := h.get(run, k)) is not None and len(t)]
    if not others:
        return "no mismatch metric logged, so engine parity cannot be judged"
    return f"engine parity is judged on {K.MISMATCH_LOGPROB_MEAN}, which it did not log (it logged {', '.join(others)})"


def parity(h: Histories, run: str, refs: Sequence[str]) -> Parity | None:
    """The candidate's `Parity`, or None when it logged no mismatch metric."""
    t = h.get(run, K.MISMATCH_LOGPROB_MEAN)
    if t is None or not len(t):
        return None
    tol = _tol(h, refs, t.steps)
    s0, v = int(t.steps[0]), t.values
    out = ~(np.isfinite(v[1:]) & (v[1:] <= tol[1:]))
    over = t.steps[1:][out]
    later = v[1:][np.isfinite(v[1:])]
    return Parity(s0, s0 == first_step(h, run), float(v[0]), float(tol[0]), _value(h, run, K.KL_NEW_OLD_K1, s0),
                  _value(h, run, K.RATIO_MEAN, s0), len(v) - 1, int(out.sum()), int(over[0]) if len(over) else None,
                  float(np.median(later)) if len(later) else math.nan)


@dataclass(frozen=True)
class Departure:
    """A candidate metric outside the reference seeds' range after the first step."""

    key: str
    step: int  # first step of the run of PERSIST_AFTER outside steps
    value: float  # the candidate's value there
    low: float  # the references' range there, widened by their wiggle
    high: float


def departures_after_updates(h: Histories, run: str, refs: Sequence[str],
                             keys: Sequence[str] = POLICY_KEYS) -> list[Departure]:
    """Metrics on which the candidate leaves the references' range (plus their step-to-step wiggle) on
    PERSIST_AFTER consecutive steps after its first step; earliest first."""
    out = []
    start = first_step(h, run)
    for key in keys:
        c = h.get(run, key)
        rs = [t for t in h.for_key(key, refs).values() if len(t) > 1]
        if c is None or len(c) < PERSIST_AFTER + 1 or not rs:
            continue
        wiggle = float(np.nanmedian(np.concatenate([np.abs(np.diff(t.values)) for t in rs])))
        keep = c.steps != start
        steps, v = c.steps[keep], c.values[keep]
        with np.errstate(all="ignore"):
            at = np.stack([_on(t, steps) for t in rs])
            at[~np.isfinite(at)] = np.nan
            seen = np.isfinite(at).any(axis=0)
            lo, hi = np.nanmin(np.where(seen, at, 0.0), axis=0), np.nanmax(np.where(seen, at, 0.0), axis=0)
            # FAR x (their range or their wiggle, the larger): a long run's seed noise makes a few steps
            # in a row outside 1x somewhere (100k steps: yes), outside 2x practically never
            width = FAR * np.maximum(np.maximum(hi - lo, wiggle if math.isfinite(wiggle) else 0.0),
                                     1e-12 * np.maximum(1.0, np.abs(hi)))
            outside = seen & np.isfinite(v) & ((v < lo - width) | (v > hi + width))
        run_len = np.convolve(outside.astype(int), np.ones(PERSIST_AFTER, int), "valid")
        hits = np.flatnonzero(run_len == PERSIST_AFTER)
        if len(hits):
            i = int(hits[0])
            out.append(Departure(key, int(steps[i]), float(v[i]), float(lo[i] - width[i]), float(hi[i] + width[i])))
    return sorted(out, key=lambda d: d.step)


@dataclass(frozen=True)
class NonFiniteSignature:
    """How a candidate's non-finite gradients look: from which step, how often, with which loss."""

    steps: tuple[int, ...]  # steps with non-finite gradients
    run_steps: int  # steps with a gradient check from the first bad one on
    from_first_step: bool  # the first bad step is the run's first step
    loss_finite: tuple[int, ...]  # bad steps at which the logged loss is finite
    loss_zero: tuple[int, ...]  # ... exactly 0.0
    real_loss: bool  # the loss was logged by rldiag's collectors (the real one, not a trainer's filtered one)

    @property
    def recurring(self) -> bool:
        """Non-finite on at least half the steps from the first bad one on (the bug repeats each batch)."""
        return 2 * len(self.steps) >= self.run_steps


def nonfinite_signature(h: Histories, run: str) -> NonFiniteSignature | None:
    """The candidate's `NonFiniteSignature`, or None for finite gradients."""
    from rldiag.app.analysis.nan_events import bad_steps

    bad = [b.step for b in bad_steps(h, run)]
    if not bad:
        return None
    grads = [t.steps for k in (K.GRAD_FINITE, K.GRAD_NORM) if (t := h.get(run, k)) is not None]
    steps = np.unique(np.concatenate(grads)) if grads else np.empty(0, np.int64)
    since = int(len(steps) - np.searchsorted(steps, bad[0], "left"))  # steps from the first bad one on
    loss = {s: _value(h, run, K.LOSS, s) for s in bad}
    finite = tuple(s for s, v in loss.items() if v is not None and math.isfinite(v))
    return NonFiniteSignature(tuple(bad), since, bad[0] == first_step(h, run), finite,
                              tuple(s for s in finite if loss[s] == 0.0), h.get(run, K.GRAD_FINITE) is not None)
