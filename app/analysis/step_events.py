"""Two step events beside a NaN gradient, each told apart from one: an fp16 loss-scaler overflow, and a
loss that went non-finite while every gradient stayed finite.

    ov = scaler_overflows(h, run_id)        # ScalerOverflows | None; ov.text()
    nl = nonfinite_loss(h, run_id)          # NonFiniteLoss | None; nl.text()
    lo = likely_overflows(h, run_id, params)  # LikelyOverflows | None: an fp16 run rldiag did not watch

A run that rldiag's collectors did not watch (transformers' own MLflowCallback) logs a scaler overflow as
an inf or NaN `grad_norm`: the NaN events list those steps, and for an fp16 run (`fp16` True in its params)
whose non-finite steps come in short streaks, each followed by finite steps, with a finite loss, a line
beside them says they are likely overflows. It is a hint, never an all-clear: the steps stay NaN events, since nothing logged tells an
overflow from a NaN gradient there.

A scaler overflow (`grad/scaler_overflow` = 1, logged by the collectors under a `torch.amp.GradScaler`) is
ordinary fp16 training: the scaler skips that optimizer step and lowers its scale. The collectors log no
`grad/finite` there, so it is never a NaN event (collectors/amp.py says when an overflow is a real NaN).

A non-finite `loss` at a step whose gradients are not non-finite is no NaN gradient either: part of the loss
carries no gradient (a term detached or computed under `no_grad`), or backward ran on another tensor than
the one logged. The NaN events and the watcher say it as its own line, and say when no gradient check was
logged at those steps (then nothing is known about the gradients).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from rldiag.app.analysis.nan_events import bad_steps
from rldiag.app.data.histories import Histories
from rldiag.app.data.steps import format_ranges
from rldiag.collectors import keys

LONG_STREAK = 8  # overflows in a row past the scale's usual settling (65536 -> 256 in 8 halvings)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


@dataclass(frozen=True)
class ScalerOverflows:
    """The steps of a run whose scaled fp16 gradients overflowed, with the loss scale at them."""

    run_id: str
    steps: tuple[int, ...]
    scales: tuple[float, ...]  # the loss scale each step's gradients were multiplied by (NaN: not logged)
    longest: int  # the most overflows in a row (consecutive logged steps)

    def text(self) -> str:
        """ "scaler overflow: 3 steps (0, 2, 4; skipped by the GradScaler, loss scale lowered: 65536 at the
        first, 16384 at the last)"."""
        n = len(self.steps)
        first, last = self.scales[0], self.scales[-1]
        if n > 1 and math.isfinite(first) and math.isfinite(last):
            scale = f": {first:g} at the first, {last:g} at the last"
        elif math.isfinite(first):
            scale = f" from {first:g}"
        else:
            scale = ""
        streak = (f"; {self.longest} in a row: more than the scale's usual settling (a NaN the scaling did not "
                  "cause overflows like this until the scale reaches 1)" if self.longest >= LONG_STREAK else "")
        return (f"scaler overflow: {_plural(n, 'step')} ({format_ranges(self.steps, limit=8)}; skipped by the "
                f"GradScaler, loss scale lowered{scale}){streak}")


def scaler_overflows(h: Histories | None, run_id: str) -> ScalerOverflows | None:
    """The run's scaler overflows, or None when it logged none (or no `grad/scaler_overflow` at all)."""
    t = h.get(run_id, keys.GRAD_SCALER_OVERFLOW) if h is not None else None
    if t is None:
        return None
    hit = t.values == 1.0
    if not hit.any():
        return None
    steps = t.steps[hit]
    scale = h.get(run_id, keys.GRAD_LOSS_SCALE)
    scales = np.full(len(steps), np.nan)
    if scale is not None and len(scale.steps):
        i = np.clip(np.searchsorted(scale.steps, steps), 0, len(scale.steps) - 1)
        found = scale.steps[i] == steps
        scales[found] = scale.values[i[found]]
    # the flag is logged at every step under a scaler: neighbouring rows are consecutive steps
    edges = np.diff(np.r_[0, hit.astype(np.int8), 0])
    longest = int((np.flatnonzero(edges == -1) - np.flatnonzero(edges == 1)).max())
    return ScalerOverflows(run_id, tuple(int(s) for s in steps), tuple(float(s) for s in scales), longest)


_TRUE = {"true", "1", "yes"}


@dataclass(frozen=True)
class LikelyOverflows:
    """Non-finite grad-norm steps of an fp16 run without rldiag's overflow flag, in short streaks."""

    run_id: str
    steps: tuple[int, ...]
    longest: int

    def text(self) -> str:
        """ "non-finite grad norm at 3 steps (0, 2, 4) of an fp16 run (fp16=True), at most 1 in a row, ...:
        likely loss-scaler overflows, ..." """
        return (f"non-finite grad norm at {_plural(len(self.steps), 'step')} ({format_ranges(self.steps, limit=8)}) "
                f"of an fp16 run (fp16=True), at most {self.longest} in a row, each followed by finite steps, with a "
                "finite loss: likely loss-scaler overflows, which the GradScaler skips itself; nothing logged tells "
                "them from NaN gradients, so they stay NaN events (rldiag's callback logs overflows apart, as "
                "grad/scaler_overflow)")


@dataclass(frozen=True)
class Streak:
    """Consecutive logged grad-norm rows of an fp16 run that are non-finite."""

    steps: tuple[int, ...]
    closed: bool  # a finite row follows it (the scaler came out of it); False while it lasts to the last row
    loss_finite: bool  # the loss is finite wherever it was logged at these steps

    def overflow(self) -> bool | None:
        """True: likely a scaler overflow; False: what a real NaN looks like; None: cannot tell yet (short,
        finite loss, and nothing logged after it)."""
        if not self.loss_finite or len(self.steps) >= LONG_STREAK:
            return False
        return True if self.closed else None


def fp16_streaks(h: Histories | None, run_id: str, params: dict[str, str] | None) -> list[Streak] | None:
    """For a run whose params say `fp16` is true and which logged no `grad/scaler_overflow`: its streaks of
    non-finite grad-norm steps in logged rows (a trainer logs every N steps), else None."""
    if h is None or not params or str(params.get("fp16", "")).strip().lower() not in _TRUE:
        return None
    if h.get(run_id, keys.GRAD_SCALER_OVERFLOW) is not None:
        return None  # rldiag told overflows apart itself
    bad = [b.step for b in bad_steps(h, run_id) if keys.GRAD_FINITE not in b.values]
    norm = h.get(run_id, keys.GRAD_NORM)
    if not bad or norm is None:
        return None
    loss = h.get(run_id, keys.LOSS)
    hit = np.isin(norm.steps, bad)
    edges = np.diff(np.r_[0, hit.astype(np.int8), 0])
    out = []
    for a, e in zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)):  # e: one past the streak
        steps = norm.steps[a:e]
        finite = True
        if loss is not None:
            at = np.isin(loss.steps, steps)
            finite = bool(np.isfinite(loss.values[at]).all())
        out.append(Streak(tuple(int(x) for x in steps), bool(e < len(norm.steps)), finite))
    return out


def likely_overflows(h: Histories | None, run_id: str, params: dict[str, str] | None) -> LikelyOverflows | None:
    """For a run whose params say `fp16` is true and which logged no `grad/scaler_overflow`: its non-finite
    grad-norm steps, when each streak of them is shorter than LONG_STREAK logged steps and followed by a
    finite one, and the loss is finite wherever it was logged at them (a NaN loss, a long streak or one
    that lasts to the run's last step is what a real NaN looks like)."""
    streaks = fp16_streaks(h, run_id, params)
    # the scaler halves its scale after an overflow and the next steps fit: a streak the run never came
    # out of (to its last logged step) is what a real NaN looks like, whatever the logged loss says
    # (transformers' Trainer replaces a NaN loss by the average of the last ones: logging_nan_inf_filter)
    if not streaks or not all(st.overflow() for st in streaks):
        return None
    return LikelyOverflows(run_id, tuple(x for st in streaks for x in st.steps), max(len(st.steps) for st in streaks))


@dataclass(frozen=True)
class NonFiniteLoss:
    """Steps where the logged loss is NaN or inf and the gradients were not flagged non-finite."""

    run_id: str
    steps: tuple[int, ...]
    values: tuple[float, ...]
    checked: bool  # a gradient check (grad/finite or a grad norm) was logged, finite, at every one of them

    def kind(self) -> str:
        kinds = {"NaN" if math.isnan(v) else ("inf" if v > 0 else "-inf") for v in self.values}
        return "/".join(k for k in ("NaN", "inf", "-inf") if k in kinds)

    def text(self) -> str:
        """ "loss NaN at 2 steps (3, 7) while every gradient is finite there: ..."."""
        where = f"{_plural(len(self.steps), 'step')} ({format_ranges(self.steps, limit=8)})"
        if self.checked:
            return (f"loss {self.kind()} at {where} while every gradient is finite there: part of the loss "
                    "carries no gradient (a detached term, a value computed under no_grad), or backward ran on "
                    "another tensor than the loss logged")
        return f"loss {self.kind()} at {where}; no gradient check was logged at these steps (unknown, not finite)"


LOSS_KEYS = (keys.LOSS, keys.LOSS_UNFILTERED)  # the unfiltered one where rldiag logs into a trainer's run


def nonfinite_loss(h: Histories | None, run_id: str) -> NonFiniteLoss | None:
    """The run's non-finite loss steps (`loss`, or rldiag's unfiltered `rldiag/loss` beside a trainer's
    filtered one) that are no NaN-gradient step (those the NaN events show already), or None."""
    found: dict[int, float] = {}
    for key in LOSS_KEYS:
        t = h.get(run_id, key) if h is not None else None
        if t is not None:
            bad = ~np.isfinite(t.values)
            for s, v in zip(t.steps[bad].tolist(), t.values[bad].tolist()):
                found.setdefault(int(s), float(v))
    if not found:
        return None
    grad_bad = {b.step for b in bad_steps(h, run_id)}
    steps = [s for s in sorted(found) if s not in grad_bad]
    if not steps:
        return None
    # any logged gradient check at the step (none is bad there)
    logged = [g.steps for k in (keys.GRAD_FINITE, keys.GRAD_NORM) if (g := h.get(run_id, k)) is not None]
    checked = bool(logged) and bool(np.isin(steps, np.concatenate(logged)).all())
    return NonFiniteLoss(run_id, tuple(steps), tuple(found[s] for s in steps), checked)


def with_overflow_hints(summaries, h: Histories | None, params: dict[str, dict[str, str]] | None) -> list:
    """`CandidateSummary`s with `likely_overflows` set where `likely_overflows` says so (their params:
    run -> params); the others as they were."""
    from dataclasses import replace

    return [replace(s, likely_overflows=True) if s.nonfinite_steps
            and likely_overflows(h, s.run_id, (params or {}).get(s.run_id)) is not None else s for s in summaries]


def step_event_lines(h: Histories | None, run_ids, labels: dict[str, str],
                     params: dict[str, dict[str, str]] | None = None) -> tuple[list[str], list[str]]:
    """`(overflow lines, loss lines)`, one per run that has them: "<run>: scaler overflow: 3 steps (...)"
    (or, for an fp16 run rldiag did not watch, "<run>: non-finite grad norm at 3 steps ... likely loss-scaler
    overflows"; `params`: run -> its params) and "<run>: loss NaN at 2 steps (...) while every gradient is
    finite there: ...", as the NaN events page and the report say them beside (never among) the NaN
    gradient steps."""
    over, loss = [], []
    for r in run_ids:
        if (ov := scaler_overflows(h, r)) is not None:
            over.append(f"{labels.get(r, r)}: {ov.text()}; an ordinary fp16 event, not a NaN gradient")
        elif (lo := likely_overflows(h, r, (params or {}).get(r))) is not None:
            over.append(f"{labels.get(r, r)}: {lo.text()}")
        if (nl := nonfinite_loss(h, r)) is not None:
            loss.append(f"{labels.get(r, r)}: {nl.text()}")
    return over, loss
