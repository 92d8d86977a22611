"""The one-line-per-run summary that every experiment prints at its end."""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence


class RunSummary(NamedTuple):
    run_id: str
    variant: str
    first_nonfinite_step: int | None  # first optimizer step whose gradients held NaN/inf; None: all finite
    final_reward: float  # reward/mean of the last step (NaN where the experiment has no reward)
    undelivered: int = 0  # metric points the writer could not deliver (0 on a healthy store)


def format_summaries(summaries: Sequence[RunSummary], *, tracking_uri: str, experiment: str) -> str:
    """An aligned table: run id, variant, first non-finite step, final reward; then where to look."""
    head = f"{'run id':32}  {'variant':24}  {'first non-finite step':>21}  {'final reward':>12}"
    lines = [head, "-" * len(head)]
    for s in summaries:
        bad = "none" if s.first_nonfinite_step is None else str(s.first_nonfinite_step)
        reward = "n/a" if math.isnan(s.final_reward) else f"{s.final_reward:.3f}"
        lost = f"  ({s.undelivered} points undelivered)" if s.undelivered else ""
        lines.append(f"{s.run_id:32}  {s.variant:24}  {bad:>21}  {reward:>12}{lost}")
    lines.append(f"Logged to {tracking_uri} (experiment {experiment!r}). Compare them with: rldiag app")
    return "\n".join(lines)
