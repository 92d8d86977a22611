"""What the detector finds for one candidate and metric (`rldiag.app.analysis.divergence`): a `Divergence`
(status DIVERGED, WITHIN or NOT_ENOUGH_STEPS) with its `Departure`s, the `Band` a chart shades, the table's
DIVERGENCE_COLUMNS, and the words the products show for them (sizes, sd cells, what a band cannot tell)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from rldiag.app.analysis.divergence_config import DivergenceConfig
from rldiag.collectors import keys as K


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


DIVERGENCE_COLUMNS = ["run_id", "key", "onset_step", "kind", "end_step", "delta", "delta_sigma",
                      "first_nonfinite_step", "steps_compared", "steps_needed", "alert_step", "detectable",
                      "candidate_level", "reference_level", "steps_after_references", "references_end_step",
                      "status", "size"]
DERIVED_COLUMNS = ("status", "size")  # properties of a Divergence, not fields: a row rebuilds one without them
