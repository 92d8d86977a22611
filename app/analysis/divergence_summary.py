"""Per candidate, what the comparison says (`summarize` -> `CandidateSummary`), for the headlines of the
report, the dashboard and `rldiag report`: non-finite gradients first, then the first departure, then how
much was compared (metrics with not enough steps, not compared, or no longer logged)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from rldiag.app.analysis.divergence_config import DivergenceConfig
from rldiag.app.analysis.divergence_results import DIVERGED, NOT_ENOUGH_STEPS, WITHIN, Divergence
from rldiag.collectors import keys as K

if TYPE_CHECKING:
    from rldiag.app.data.histories import Histories


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
