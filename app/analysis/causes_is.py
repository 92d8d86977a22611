"""The likely cause "importance weights degenerate" (`is_health`: an ESS drop with a rising mismatch), and
that evidence cited by the train-inference mismatch causes it follows from.

Kept apart from `causes` (which calls `is_cause` as one of its rules and `with_is_evidence` on the ranked
list): the cause is named only where `is_health` found the event, with its numbers as the signature.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from rldiag.app.analysis import causes_settings as S
from rldiag.app.analysis.is_health import is_health
from rldiag.app.data.histories import Histories

IS_CAUSE = "is_degenerate"
TITLE = "importance weights degenerate (ESS drop with rising mismatch)"
# the causes whose mismatch the ESS drop follows from: they cite the event as evidence
MISMATCH_CAUSES = frozenset({"raw_logprobs", "recompute_sampling", "logprob_semantics", "engine_precision",
                             "lm_head_precision", "numerics", "prefix_cache", "stale_weights"})
FIX = ("correct the engine-trainer ratio: truncated importance sampling (cap exp(lp_trainer - lp_engine) per token: "
       "TRL vllm_importance_sampling_correction=True with vllm_importance_sampling_cap, verl's rollout correction) "
       "or mask the tokens whose ratio leaves a band; then remove the mismatch at its source")
SOURCE = ("verl's rollout correction (truncated and masked importance sampling, with its effective sample size); "
          "TRL GRPOConfig vllm_importance_sampling_correction")
TRL_CORRECTION = "vllm_importance_sampling_correction"


def is_cause(h: Histories, run: str, refs: Sequence[str], params: Mapping[str, str], make: Callable) -> list:
    """[make(...)] (a `causes.Cause`) where `is_health` finds an ESS drop with a rising mismatch, else []."""
    ev = is_health(h, run, refs).first
    if ev is None:
        return []
    off = S.find(params, (TRL_CORRECTION,))
    if off is not None and off[1] == "False":
        return [make(IS_CAUSE, TITLE, (ev.text(),), (f"{off[0]}=False: the engine-trainer ratio is not corrected",),
                     FIX, SOURCE, step=ev.step)]
    return [make(IS_CAUSE, TITLE, (ev.text(),), (), FIX, SOURCE,
                 hint="metrics only: no setting turns the correction off", step=ev.step)]


def with_is_evidence(causes: list) -> list:
    """`causes` with the train-inference mismatch causes citing the ESS drop (the `is_degenerate` cause's
    signature) as evidence, where that cause was found."""
    found = next((c for c in causes if c.id == IS_CAUSE), None)
    if found is None:
        return causes
    cite = f"then the importance weights degenerate: {found.signature[0]}"
    return [replace(c, signature=(*c.signature, cite)) if c.id in MISMATCH_CAUSES else c for c in causes]
