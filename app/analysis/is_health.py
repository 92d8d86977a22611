"""Importance-sampling health: a drop in the effective sample size while a mismatch metric rises.

    health = is_health(histories, run_id, reference_ids)   # references optional
    health.first      # the first ISEvent (or None): its step and the numbers that make it one
    health.line()     # the first event's text, or why there is none ("not logged: ...", "too few steps ...")

The normalised effective sample size of the importance weights (`policy/ess`, (sum r)^2 / (n sum r^2),
1 = on-policy; `policy/ess_seq` where only the sequence one is logged) says how many of a batch's samples
the gradient still counts. A drop with a rising train-inference mismatch (the low-probability share,
the logprob difference, NeMo-RL's token_mult_prob_error, the new/old KL) is the precursor of a collapse
the recent reports describe: the weights degenerate because the engine and the trainer disagree.

Physical thresholds, not ones fitted to an experiment:
- a drop: the ESS at least `ESS_DROP` (a fifth) below its baseline, on `PERSIST` consecutive logged
  steps. The baseline is the references' lowest ESS at the same step (seed noise stays above it), or,
  without references that logged it, the median of the run's own first `BASE` logged values;
- a rise: a mismatch metric at least `RISE` times its baseline (its excess over parity: 1.0 for
  token_mult_prob_error, 0 for the others) and above it by more than `FLOOR[key]` (rounding-level
  mismatch doubling from 1e-7 is no rise), at the same steps. Its baseline is the references' highest
  value at the step, or the median of the run's own first `BASE` values.
A key that is not logged is said ("not logged"), never read as healthy.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rldiag.app.data.histories import Histories
from rldiag.collectors import keys as K

ESS_DROP = 0.2  # the ESS at least this fraction below its baseline: the batch counts a fifth fewer samples
RISE = 2.0  # a mismatch metric at least this many times its baseline (excess over parity)
PERSIST = 3  # consecutive logged steps of both
BASE = 10  # without references: the run's own first logged values that make the baseline
ESS_KEYS = (K.POLICY_ESS, K.POLICY_ESS_SEQ)  # the token one where logged, else the sequence one
# mismatch metrics, in the order the evidence names them; the floor a rise must clear, in the key's unit
FLOOR: dict[str, float] = {
    K.MISMATCH_LOW_PROB_SHARE: 1e-3,  # a tenth of a percent of sampled tokens
    K.MISMATCH_LOGPROB_MEAN: 1e-4,  # nats: causes_signatures.PARITY_TOL
    K.MISMATCH_TOKEN_MULT_PROB_ERROR: 1e-4,  # excess over 1.0 ~ mean |delta logprob|
    K.KL_NEW_OLD: 1e-4,  # k3 ~ (delta logprob)^2 / 2
    K.MISMATCH_LOGPROB_MAX: 1e-3,
    K.MISMATCH_PROB_MAX: 1e-3,
}
PARITY_VALUE = {K.MISMATCH_TOKEN_MULT_PROB_ERROR: 1.0}  # the value at parity (0 for the others)
MISMATCH_KEYS = tuple(FLOOR)
IS_KEYS = (*ESS_KEYS, *MISMATCH_KEYS)  # what to load
NOT_LOGGED = "importance-sampling health not logged"


def _g(x: float) -> str:
    return f"{x:.3g}"


@dataclass(frozen=True)
class Rise:
    """A mismatch metric over an ESS drop: its baseline and its median over the drop's steps."""

    key: str
    before: float
    after: float

    def text(self) -> str:
        return f"{self.key} rose {_g(self.before)} -> {_g(self.after)}"


@dataclass(frozen=True)
class ISEvent:
    """A stretch of steps where the ESS is down and a mismatch metric up: the numbers that make it one."""

    run_id: str
    step: int  # its first step
    last_step: int  # its last step so far
    ess_key: str
    ess_before: float  # the baseline
    ess_after: float  # the median over the stretch
    against: str  # "the references" or "its first N logged values"
    rises: tuple[Rise, ...]

    def text(self) -> str:
        """ "policy/ess 0.97 -> 0.41 (median of steps 40-59, against ...) from step 40, while ... rose ..." """
        span = f"step {self.step}" if self.step == self.last_step else f"steps {self.step}-{self.last_step}"
        return (f"{self.ess_key} {_g(self.ess_before)} -> {_g(self.ess_after)} from step {self.step} (median of "
                f"{span}, against {self.against}), while " + ", ".join(r.text() for r in self.rises))


@dataclass(frozen=True)
class ISHealth:
    """A run's ESS-drop-with-rising-mismatch events (earliest first), or why there is none."""

    run_id: str
    events: tuple[ISEvent, ...]
    note: str  # why no event: not logged, too few steps, or what was checked (never an all-clear alone)

    @property
    def first(self) -> ISEvent | None:
        return self.events[0] if self.events else None

    @property
    def logged(self) -> bool:
        return not self.note.startswith(NOT_LOGGED)

    def line(self) -> str:
        return f"importance weights degenerate: {self.first.text()}" if self.first else self.note


def _at(t, steps: np.ndarray) -> np.ndarray:
    """`t`'s values at `steps` (`Trace.at`), all NaN where there is no trace."""
    return np.full(len(steps), np.nan) if t is None else t.at(steps)


def _own_base(t) -> float:
    v = t.values[np.isfinite(t.values)][:BASE]
    return float(np.median(v)) if len(v) else math.nan


def _baseline(h: Histories, run: str, key: str, refs: Sequence[str], steps: np.ndarray,
              low: bool) -> tuple[np.ndarray, bool]:
    """Per step: the references' lowest (`low`) or highest value there, or the run's own first-BASE median;
    and whether the references gave it."""
    at = [_at(t, steps) for t in h.for_key(key, refs).values()] if refs else []
    if at:
        stack = np.stack(at)
        stack[~np.isfinite(stack)] = np.nan
        if np.isfinite(stack).any():
            with warnings.catch_warnings():  # a step no reference logged: NaN, not judged
                warnings.simplefilter("ignore", RuntimeWarning)
                return (np.nanmin(stack, axis=0) if low else np.nanmax(stack, axis=0)), True
    return np.full(len(steps), _own_base(h.get(run, key))), False


def _stretches(hit: np.ndarray) -> list[tuple[int, int]]:
    """(first, last) index of each run of at least PERSIST consecutive True."""
    out, start = [], None
    for i, x in enumerate([*hit.tolist(), False]):
        if x and start is None:
            start = i
        elif not x and start is not None:
            if i - start >= PERSIST:
                out.append((start, i - 1))
            start = None
    return out


def is_health(h: Histories, run: str, refs: Sequence[str] = ()) -> ISHealth:
    """The run's `ISHealth`: each stretch of PERSIST+ steps where its ESS is ESS_DROP below the baseline
    while a mismatch metric is RISE times above its own. Load IS_KEYS into `h`."""
    refs = tuple(r for r in refs if r != run)
    ess_key = next((k for k in ESS_KEYS if (t := h.get(run, k)) is not None and len(t)), None)
    present = [k for k in MISMATCH_KEYS if (t := h.get(run, k)) is not None and len(t)]
    if ess_key is None:
        return ISHealth(run, (), f"{NOT_LOGGED}: no effective sample size ({K.POLICY_ESS})")
    if not present:
        return ISHealth(run, (), f"{NOT_LOGGED}: {ess_key} without a mismatch metric ("
                        f"{', '.join(MISMATCH_KEYS[:3])}, ...)")
    t = h.get(run, ess_key)
    steps, ess = t.steps, t.values
    base, by_refs = _baseline(h, run, ess_key, refs, steps, low=True)
    need = PERSIST if by_refs else BASE + PERSIST
    if np.isfinite(ess).sum() < need:
        return ISHealth(run, (), f"importance-sampling health: too few steps ({int(np.isfinite(ess).sum())} "
                        f"{ess_key} values, {need} needed)")
    with np.errstate(all="ignore"):
        low = np.isfinite(ess) & np.isfinite(base) & (ess <= (1 - ESS_DROP) * base)
        rising, levels = {}, {}
        for k in present:
            zero = PARITY_VALUE.get(k, 0.0)
            v = _at(h.get(run, k), steps) - zero
            b = _baseline(h, run, k, refs, steps, low=False)[0] - zero
            rising[k] = np.isfinite(v) & np.isfinite(b) & (v >= RISE * np.maximum(b, 0.0)) & (v - b > FLOOR[k])
            levels[k] = (v + zero, b + zero)
    hit = low & np.any(np.stack(list(rising.values())), axis=0)
    against = "the references" if by_refs else f"its first {BASE} logged values"
    events = []
    for i, j in _stretches(hit):
        sl = slice(i, j + 1)

        def rise(k: str, sl: slice = sl) -> Rise:
            return Rise(k, float(np.nanmedian(levels[k][1][sl])), float(np.nanmedian(levels[k][0][sl])))

        # the metrics up on at least half the stretch's steps (else each one up on any of them)
        rises = (tuple(rise(k) for k in present if 2 * rising[k][sl].sum() >= j - i + 1)
                 or tuple(rise(k) for k in present if rising[k][sl].any()))
        events.append(ISEvent(run, int(steps[i]), int(steps[j]), ess_key, float(np.nanmedian(base[sl])),
                              float(np.median(ess[sl])), against, rises))
    if events:
        return ISHealth(run, tuple(events), "")
    drops = _stretches(low)
    checked = ", ".join(present)
    if drops:
        i, j = drops[0]
        return ISHealth(run, (), f"{ess_key} drops {_g(float(np.nanmedian(base[i:j + 1])))} -> "
                        f"{_g(float(np.median(ess[i:j + 1])))} from step {int(steps[i])} (against {against}) with no "
                        f"rise of {checked}: not the mismatch event (large updates or stale rollouts also lower it)")
    return ISHealth(run, (), f"no {ess_key} drop with a rising mismatch ({checked}) over {len(steps)} steps")
