"""Each fact of a verdict worded once: the likely causes, the report and the dashboard use these.

Terms, as used here and in every product:
- parity: the engine's and the trainer's logprobs agree within the tolerance (`parity_text`); said only
  of a run at parity, never of the tolerance alone;
- range: the reference seeds' min-max at a step, widened (`range_text`); never below 0 for a metric
  that cannot be negative (`NON_NEGATIVE`);
- band: the divergence detector's noise band around the references;
- alert: the step a watcher polling every step first reports a departure at (`Departure.alert_step`);
- onset: where the departure started, placed after the fact (`Departure.onset_step`, at or before the
  alert); every product says both, one way (`when_text`): "alerted at step A (started about step O)";
- a departure's size: in metric units for a level, in noise terms for a variance (`departure_size`).
Sources are cited by what they say, never by a file path.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from rldiag.collectors import keys as K

SOURCE_PIPELINERL = ("PipelineRL's vLLM V0 -> V1 migration: V1 matched V0 only with processed logprobs "
                     "(logprobs-mode=processed_logprobs), no prefix caching or async scheduling, synced weights and "
                     "an fp32 lm_head")
SOURCE_TRL = ("the TRL distillation fix 'reverse-KL server path NaN on variable completion length': with batch x "
              "accumulation > 1, -inf padding reached backward (finite loss, grad_norm NaN from step 1); the fix masks "
              "it as the forward-KL path does")
# Metrics that cannot be negative: a rate or share, an entropy, a norm, a mean |delta logprob|, a count, an
# importance ratio or ESS, and the k3 KL new/old (r - 1 - log r >= 0: every alias of it is k3, app/data/aliases_sources;
# the k1 estimate, policy/kl_new_old_k1, and policy/kl_ref, k1 in some frameworks, can be negative).
NON_NEGATIVE = frozenset({K.CLIP_RATE, K.CLIP_ACTIVE_RATE, K.CLIP_RATE_SEQ, K.ENTROPY, K.GRAD_NORM,
                          K.MISMATCH_LOGPROB_MEAN, K.MISMATCH_LOGPROB_MAX, K.MISMATCH_PROB_MAX,
                          K.MISMATCH_TOKEN_MULT_PROB_ERROR, K.MISMATCH_LOW_PROB_SHARE, K.BATCH_TOKENS,
                          K.BATCH_SEQUENCES, K.TRL_CLIPPED_RATIO, K.KL_NEW_OLD, K.POLICY_ESS, K.POLICY_ESS_SEQ,
                          K.RATIO_MEAN, K.RATIO_MAX, K.RATIO_MIN, K.RATIO_MEAN_SEQ, K.RATIO_MAX_SEQ, K.RATIO_MIN_SEQ,
                          K.REWARD_STD, K.GRAD_NONFINITE_PARAMS})
_SEED = ("seed",)


def _g(x: float) -> str:
    return f"{x:.4g}"


def range_text(key: str, value: float, low: float, high: float) -> str:
    """ "0.3398 vs 0 to 0.02344": the value against the range, the low end at 0 for a NON_NEGATIVE metric."""
    if K.canonical_key(key) in NON_NEGATIVE:
        low = max(low, 0.0)
    return f"{_g(value)} vs {_g(low)} to {_g(high)}"


def parity_text(mean: float, tol: float) -> str:
    """ "at parity (mismatch mean 2e-07, within the 1e-04 tolerance)" or "mismatch mean 0.498, not at
    parity (tolerance 1e-04)": a run is said at parity only where it is."""
    if math.isfinite(mean) and mean <= tol:
        return f"at parity (mismatch mean {mean:.2g}, within the {tol:.0e} tolerance)"
    return f"mismatch mean {mean:.3g}, not at parity (tolerance {tol:.0e})"


def departure_size(kind: str | None, delta: float, delta_sigma: float, candidate: float = math.nan,
                   reference: float = math.nan) -> str:
    """A departure's size in its own terms: "noise x2.9 the reference's" (variance), "delta +0.26" (level,
    with "1.263 vs 1 (+26%)" where both levels are known), "non-finite where the references are finite"."""
    if kind == "nonfinite":
        return "non-finite where the references are finite"
    if kind == "variance":
        return (f"noise x{delta_sigma:.1f} the reference's" if math.isfinite(delta_sigma)
                else "noise larger than the reference's")
    if math.isfinite(candidate) and math.isfinite(reference):
        rel = (candidate - reference) / abs(reference) if reference else math.nan
        pct = f" ({rel:+.0%})" if math.isfinite(rel) and abs(rel) < 100 else ""
        return f"{_g(candidate)} vs {_g(reference)}{pct}"
    return f"delta {delta:+.3g}" if math.isfinite(delta) else "size unknown"


def _seeds(params: Mapping[str, str]) -> dict[str, str]:
    """Every seed-like param (`seed`, `loop.seed`, `engine.seed`, ...): a run may log several, and one of them
    (an engine's) can be the same in every run while another (the loop's) tells the runs apart."""
    return {k: v for k, v in params.items() if k.rsplit(".", 1)[-1].lower() in _SEED}


def same_params_note(params: Mapping[str, str], references: Sequence[Mapping[str, str]]) -> str:
    """Why no setting explains a candidate whose params equal its references' but for run-specific ones:
    "its params differ from the references' only in seed" only where its seeds equal no reference's."""
    mine, theirs = _seeds(params), [_seeds(r) for r in references]
    if not mine:
        return "its params equal the references' (it logged no seed)"
    if not any(theirs):
        return "its params equal the references' (they logged no seed)"
    if mine not in theirs:
        return "its params differ from the references' only in seed"
    shown = ", ".join(f"{k} {v}" if len(mine) > 1 else f"seed {v}" for k, v in mine.items())
    return f"its params equal a reference's, {shown} included (a rerun of the same configuration)"


def when_text(onset_step: int | None, alert_step: int | None) -> str:
    """When a departure happened, worded once for the report, the page, the chart marker and the watcher:
    "alerted at step A (started about step O)", "at step O" where the alert is the onset (or unknown)."""
    if alert_step is None or onset_step is None or alert_step == onset_step:
        return f"at step {onset_step if onset_step is not None else alert_step}"
    return f"alerted at step {alert_step} (started about step {onset_step})"


def came_back_text(end_step: int | None) -> str:
    """ ", came back after step E" for a departure that ended (E its last step out), "" for one that lasts."""
    return "" if end_step is None else f", came back after step {end_step}"


def departure_when(d) -> str:
    """A `Departure`'s when: `when_text`, and `came_back_text` where it ended."""
    return when_text(d.onset_step, d.alert_step) + came_back_text(d.end_step)


def sentence_size(d) -> str:
    """A `Departure`'s size in a sentence: "delta 0.0787: 1.079 vs 1 (+8%, +5.3 sd)" (level), "noise x2.9
    the reference's" (variance), "exactly 0 at 62% of steps vs 30%" (zero_rate), "non-finite where the
    references are finite"."""
    from rldiag.app.analysis.divergence import size_text, zero_rate_text

    if d.kind == "zero_rate":
        return zero_rate_text(d.candidate, d.reference)
    if d.kind in ("nonfinite", "variance"):
        return departure_size(d.kind, d.delta, d.delta_sigma)
    delta = f"{d.delta:.3g}" if math.isfinite(d.delta) else "-"
    return f"delta {delta}: " + size_text(d.candidate, d.reference, d.delta_sigma)


def departure_sentence(key: str, d, size: str | None = None) -> str:
    """Where a candidate leaves the band of `key` (a `Departure`), when and by how much, worded once for the
    report, the Compare page and the watcher: "loss leaves the reference band, alerted at step 12 (started
    about step 9), came back after step 40 (level, delta 0.08: 1.08 vs 1 (+8%, +5.3 sd))". `size`: in place
of `sentence_size` (a table row keeps a variance's ratio in its own column)."""
    when = departure_when(d)
    return (f"{key} leaves the reference band{' ' if when.startswith('at ') else ', '}{when} "
            f"({d.kind}, {size or sentence_size(d)})")


def _step(v) -> int | None:
    """A table cell's step: None for None or NaN (a pandas column of steps and Nones)."""
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else int(v)


def row_sentence(row: Mapping) -> str:
    """`departure_sentence` of a `divergence_frame` row (its metric's first departure; a row without
    `alert_step` reads its onset as the alert): the report's divergence lines and the watcher's events."""
    from rldiag.app.analysis.divergence import Departure

    onset = _step(row["onset_step"])
    if onset is None:
        return f"{row['key']} stays within the reference band"
    alert = _step(row.get("alert_step"))
    d = Departure(row["kind"], onset, onset if alert is None else alert, _step(row["end_step"]),
                  row.get("candidate_level", math.nan), row.get("reference_level", math.nan), row["delta"],
                  row["delta_sigma"])
    # a row keeps a variance's ratio in its size, not in delta_sigma: in noise terms, never a level's delta
    size = (row.get("size") or "noise larger than the reference's") if row["kind"] == "variance" else None
    return departure_sentence(row["key"], d, size)


def check_failed(check: str, e: Exception) -> str:
    """ "cause check failed: padding (TypeError: ...)", the error's first line only."""
    first = (str(e).strip().splitlines() or [""])[0][:200]
    return f"cause check failed: {check} ({type(e).__name__}{': ' + first if first else ''})"


__all__ = ["NON_NEGATIVE", "SOURCE_PIPELINERL", "SOURCE_TRL", "came_back_text", "check_failed", "departure_sentence",
           "departure_size", "departure_when", "parity_text", "range_text", "row_sentence", "same_params_note",
           "sentence_size", "when_text"]


# ---- one row per candidate: the experiments' closing table and the Compare page's first screen ------------
STATUS_WORDS = {
    "nonfinite": "non-finite gradients",
    "diverged": "departs",
    "within": "within the band",
    "not_enough_steps": "cannot tell (too few steps)",
    "not_compared": "not compared",
}


class VerdictRow(NamedTuple):
    """A candidate in one line: its verdict, where it first departs and why (`verdict_rows`)."""

    run: str  # its label
    verdict: str  # STATUS_WORDS of its status; "within the band" only for a clean candidate no cause fits
    departs: str  # "grad/finite 0 at step 1", "policy/clip_rate alerted at step 8 (started about step 3)", or "-"
    # (a departure that ended adds ", came back after step E": it leads only where nothing lasts)
    cause: str  # the first likely cause's title, or "-"
    fix: str  # that cause's fix, or ""


def verdict_rows(comparison, labels: Mapping[str, str]) -> list[VerdictRow]:
    """One `VerdictRow` per candidate of a `rldiag.app.compare` result, in candidate order."""
    return rows_of(comparison.summaries, comparison.causes, labels)


def rows_of(summaries: Sequence, causes: Sequence, labels: Mapping[str, str]) -> list[VerdictRow]:
    """`verdict_rows` from a comparison's per-candidate summaries and likely causes (as a report keeps them)."""
    by_run = {c.run_id: c for c in causes}
    rows = []
    for s in summaries:
        found = by_run.get(s.run_id)
        if s.first_nonfinite_step is not None:
            departs = f"grad/finite 0 at step {s.first_nonfinite_step}"
        elif s.first is not None:  # the metric the headline leads with: lasting, then largest
            departs = f"{s.first.key} {departure_when(s.first.lead)}"
        else:
            departs = "-"
        cause = found.first if found is not None else None
        verdict = STATUS_WORDS.get(s.status, s.status)
        if s.status == "within" and not s.clean:  # a metric stops early, on too few steps, gradients unchecked...
            verdict = "no departure found, not an all-clear"
        elif s.status == "within" and cause is not None:  # its own signature, outside the band test
            verdict = "no departure from the band, but a likely cause fits"
        rows.append(VerdictRow(labels.get(s.run_id, s.run_id), verdict, departs,
                               cause.title if cause is not None else "-", cause.fix if cause is not None else ""))
    return rows
