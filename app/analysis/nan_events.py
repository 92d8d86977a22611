"""Non-finite gradient events per run: which steps, which parameters, which samples and tokens.

The steps come from the metrics, so every run shows them, also one that rldiag never wrote: rldiag's
`grad/finite` = 0, or a NaN/inf grad norm (`grad_norm` of transformers/TRL, verl's `actor/grad_norm`,
mapped by the alias table). What the collectors' alerts add is read from the run: the events file
`rldiag/alerts.jsonl` (stored when the run ends) or, while it runs, the `rldiag.alert.last` tag.

    events = nan_events(histories, store, run_ids)   # DataFrame, one row per (run, non-finite step)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from rldiag.app.data.alerts import load_alert_events
from rldiag.app.data.histories import Histories
from rldiag.app.data.store import Store
from rldiag.collectors import keys

# skipped: 1.0 the weights did not change there (policy skip, or a loss scaler skipped the step), 0.0 the optimizer
# stepped on it, None unknown (an older rldiag, another trainer): the alert's field, else grad/skipped
COLUMNS = ["run_id", "step", "grad_norm", "params", "n_params", "positions", "source", "skipped"]


@dataclass(frozen=True)
class BadStep:
    """One non-finite step of a run: the grad norm there (NaN if none was logged) and what flagged it."""

    step: int
    grad_norm: float
    values: dict[str, float]  # key as logged -> its value at this step


def bad_steps(h: Histories, run_id: str) -> list[BadStep]:
    """Steps of `run_id` in `h` with non-finite gradients, ascending: `grad/finite` is 0 or NaN (a NaN
    flag is no all-clear), or the grad norm (any trainer's name for it) is NaN or +-inf."""
    found: dict[int, dict[str, float]] = {}
    norm = h.get(run_id, keys.GRAD_NORM)
    if norm is not None:
        bad = ~np.isfinite(norm.values)
        for s, v in zip(norm.steps[bad].tolist(), norm.values[bad].tolist()):
            found.setdefault(s, {})[norm.source_key] = v
    flag = h.get(run_id, keys.GRAD_FINITE)
    if flag is not None:
        bad = (flag.values == 0.0) | np.isnan(flag.values)
        for s, v in zip(flag.steps[bad].tolist(), flag.values[bad].tolist()):
            found.setdefault(s, {})[flag.source_key] = v
    out = []
    for s in sorted(found):
        gn = math.nan
        if norm is not None:
            i = int(np.searchsorted(norm.steps, s))
            if i < len(norm.steps) and norm.steps[i] == s:
                gn = float(norm.values[i])
        out.append(BadStep(s, gn, found[s]))
    return out


def empty_steps(h: Histories, run_id: str) -> list[int]:
    """Steps where `run_id` logged `batch/valid_tokens` = 0: every completion token masked (a truncation
    or masking bug), so its policy metrics there are an empty batch's placeholders (ratio 1, KL 0, clip
    rate 0: `collectors.metrics`), not measurements, and would read as a perfect step."""
    t = h.get(run_id, keys.BATCH_TOKENS)
    return [] if t is None else t.steps[t.values == 0.0].tolist()


def truncated_masked_steps(h: Histories, run_id: str, params: Mapping[str, str] | None) -> list[int]:
    """Steps where TRL masked every completion: `completions/clipped_ratio` 1 (every completion cut at
    max_completion_length) in a run whose params say mask_truncated_completions=True. TRL then zeroes the
    whole completion mask, and its loss, kl, entropy and clip ratios there are an empty batch's 0."""
    if str((params or {}).get(keys.TRL_MASK_TRUNCATED, "")).strip().lower() != "true":
        return []
    t = h.get(run_id, keys.TRL_CLIPPED_RATIO)
    return [] if t is None else t.steps[t.values == 1.0].tolist()


def no_token_steps(h: Histories, run_id: str, params: Mapping[str, str] | None) -> list[int]:
    """Every step of `run_id` with no valid token, ascending: `empty_steps` and `truncated_masked_steps`."""
    return sorted({*empty_steps(h, run_id), *truncated_masked_steps(h, run_id, params)})


def with_truncation_hints(summaries: Sequence, h: Histories, params: Mapping[str, Mapping[str, str]] | None) -> list:
    """`CandidateSummary`s with the steps `truncated_masked_steps` finds (their params: run -> params) added
    to `empty_steps`, and `empty_truncated` set; the others as they were."""
    from dataclasses import replace

    out = []
    for s in summaries:
        found = truncated_masked_steps(h, s.run_id, (params or {}).get(s.run_id))
        steps = tuple(sorted({*s.empty_steps, *found}))
        out.append(replace(s, empty_steps=steps, empty_truncated=True) if found else s)
    return out


def unchecked_steps(h: Histories, run_id: str) -> list[int]:
    """Steps where rldiag's collectors found no gradient to check (`grad/found` = 0: DeepSpeed ZeRO's own
    buffers, a call after zero_grad): unknown, so never counted as finite."""
    t = h.get(run_id, keys.GRAD_FOUND)
    return [] if t is None else t.steps[t.values == 0.0].tolist()


def unchecked_text(unchecked: dict[str, list[int]], labels: dict[str, str]) -> str:
    """One sentence naming the runs whose gradients were not checked at some steps ('' when none)."""
    from rldiag.app.data.steps import format_ranges

    parts = [f"{labels.get(r, r)} at steps {format_ranges(s, limit=8)}" for r, s in unchecked.items() if s]
    return ("Gradients not checked (no gradient found, so unknown, not finite): " + "; ".join(parts) + ".") if parts else ""


def _positions_text(positions: list[dict]) -> str:
    parts = []
    for p in positions:
        s = f"sample {p.get('sample')}" + (f" token {p['position']}" if p.get("position") is not None else "")
        if p.get("micro_batch") is not None:
            s = f"micro-batch {p['micro_batch']} " + s
        if p.get("rank") is not None:
            s = f"rank {p['rank']} " + s
        parts.append(s)
    return "; ".join(parts)


def nan_events(h: Histories, store: Store | str | None, run_ids: Sequence[str] | None = None,
               alerts: dict[str, list[dict]] | None = None) -> pd.DataFrame:
    """One row per (run, step with non-finite gradients), ascending: the grad norm, the parameters and
    the sample/token positions where the alerts name them, and where the row came from (`alerts`, `tag`
    or `metrics`). `alerts` as `rldiag.app.data.alerts.load_alert_events` returns them (read here when None)."""
    run_ids = list(run_ids if run_ids is not None else h.run_ids)
    if alerts is None:
        alerts = load_alert_events(store, run_ids)
    rows = []
    for run_id in run_ids:
        by_step = {int(e["step"]): e for e in alerts.get(run_id, []) if "step" in e}
        steps = {b.step: b.grad_norm for b in bad_steps(h, run_id)}
        logged = h.get(run_id, keys.GRAD_SKIPPED)
        skipped = dict(zip(logged.steps.tolist(), logged.values.tolist())) if logged is not None else {}
        for step in sorted(set(steps) | set(by_step)):
            e = by_step.get(step, {})
            params = list(e.get("params", []))
            norm = steps.get(step, e.get("grad_norm", float("nan")))
            rows.append({"run_id": run_id, "step": step, "grad_norm": float(norm),
                         "params": ", ".join(params), "n_params": len(params) if e else None,
                         "positions": _positions_text(e.get("positions", [])),
                         "source": e.get("source", "alerts") if e else "metrics",
                         "skipped": _skipped(e.get("skipped"), skipped.get(step))})
    return pd.DataFrame(rows, columns=COLUMNS)


def _skipped(alerted, logged) -> float | None:
    """Whether the weights stayed as they were at a bad step: the alert's `skipped`, else grad/skipped."""
    if isinstance(alerted, bool):
        return 1.0 if alerted else 0.0
    if logged is not None and logged == logged:  # not NaN
        return 1.0 if logged >= 0.5 else 0.0
    return None
