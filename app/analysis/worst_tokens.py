"""The worst token of each step: where the trainer and the engine disagree most (`mismatch/worst/*`).

The collectors log, per step, the sample, position, token id and both logprobs of the token with the
largest `|lp_trainer - lp_engine|` (`rldiag.collectors.metrics.worst_tokens`). This reads them back:

    worst = worst_tokens(histories, run_id)            # one WorstToken per step that logged one
    worst_of_run(worst).line()                          # "worst token at step 4: sample 3, position 17, ..."
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from rldiag.app.data.histories import Histories
from rldiag.collectors import keys

Decoder = Callable[[int], str]


@dataclass(frozen=True)
class WorstToken:
    step: int
    sample: int  # the row of the step's batch
    position: int  # the completion position
    token_id: int  # -1 when the trainer logged no token ids
    lp_trainer: float
    lp_engine: float

    @property
    def abs_diff(self) -> float:
        return abs(self.lp_trainer - self.lp_engine)

    def line(self, decode: Decoder | None = None) -> str:
        """`worst token at step 4: sample 3, position 17, token 'foo' (id 42), trainer -2.10 vs engine -0.31`."""
        if self.token_id < 0:
            token = "token id not logged"
        elif decode is not None:
            token = f"token {decode(self.token_id)!r} (id {self.token_id})"
        else:
            token = f"token id {self.token_id}"
        return (f"worst token at step {self.step}: sample {self.sample}, position {self.position}, {token}, "
                f"trainer {self.lp_trainer:.2f} vs engine {self.lp_engine:.2f}")


def worst_tokens(h: Histories, run_id: str) -> list[WorstToken]:
    """Every step of `run_id` that logged a worst token, in step order (steps without a valid token left out)."""
    traces = [h.get(run_id, k) for k in keys.WORST_TOKEN_KEYS]
    if any(t is None for t in traces):
        return []
    columns = [dict(zip(t.steps.tolist(), t.values.tolist())) for t in traces]
    out = []
    for step in sorted(set.intersection(*(set(c) for c in columns))):
        sample, position, token, lp_t, lp_e = (c[step] for c in columns)
        if math.isnan(sample) or sample < 0:  # -1: the step had no valid token
            continue
        out.append(WorstToken(int(step), int(sample), int(position), int(token), lp_t, lp_e))
    return out


def worst_of_run(tokens: Sequence[WorstToken]) -> WorstToken | None:
    """The step whose worst token disagrees most (a NaN logprob counts as the largest)."""
    def key(w: WorstToken) -> float:
        d = w.abs_diff
        return math.inf if math.isnan(d) else d

    return max(tokens, key=key, default=None)


def worst_token_lines(h: Histories | None, labels: Mapping[str, str],
                      decoders: Mapping[str, Decoder] | None = None) -> list[str]:
    """One line per run of `labels` that logged worst tokens: `label: worst token at step N: ...`."""
    if h is None:
        return []
    lines = []
    for run_id, label in labels.items():
        worst = worst_of_run(worst_tokens(h, run_id))
        if worst is not None:
            lines.append(f"{label}: {worst.line((decoders or {}).get(run_id))}")
    return lines


__all__ = ["WorstToken", "worst_of_run", "worst_token_lines", "worst_tokens"]
