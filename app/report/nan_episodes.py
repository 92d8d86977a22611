"""Non-finite gradient events (`rldiag.app.analysis.nan_events.nan_events`, one row per step) grouped into
episodes: one per run and stretch of consecutive bad steps, said in one line each.

    for ep in nan_episodes(events, histories):
        ep.steps_text, ep.params_text, ep.positions_text   # "1-40", "30 parameter tensors, the same at every step", ...
        ep.rows                                            # the per-step rows behind it (the detail on demand)
        origin_text(ep, alerts)                            # where its NaN entered, if an alert says it

A stretch ends at a logged step whose gradients were finite (grad/finite or the grad norm logged and
fine), so a trainer that logs every 10th step still has one episode for steps 10, 20, 30; without
those metrics, at a gap in the step numbers. The report and the NaN events page both show these lines.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from rldiag.app.data.histories import Histories
from rldiag.app.data.steps import format_ranges
from rldiag.collectors import keys

_POSITION = re.compile(r"^(?P<where>.*?)(?: token (?P<token>-?\d+))?$")
SHOWN_SAMPLES = 3  # sample groups named in an episode's line; the rest are counted


@dataclass(frozen=True)
class Episode:
    run_id: str
    rows: pd.DataFrame  # the nan_events rows of the episode, ascending step

    @property
    def steps(self) -> list[int]:
        return [int(s) for s in self.rows["step"]]

    @property
    def first_step(self) -> int:
        return self.steps[0]

    @property
    def steps_text(self) -> str:
        """ "1-40", "10, 20, 30" (steps as ranges)."""
        return format_ranges(self.steps, limit=6)

    @property
    def steps_label(self) -> str:
        """ "steps 1-40", "step 200"."""
        return ("steps " if len(self.rows) > 1 else "step ") + self.steps_text

    @property
    def norm_text(self) -> str:
        """ "NaN", or the kinds with their counts where they mix: "NaN x38, inf x2"."""
        kinds = Counter(_norm_kind(v) for v in self.rows["grad_norm"])
        if len(kinds) == 1:
            return next(iter(kinds))
        return ", ".join(f"{k} x{n}" for k, n in kinds.most_common())

    @property
    def skipped_text(self) -> str:
        """What the optimizer did there: "skipped: the weights did not change", "stepped on it (policy warn)",
        "skipped at 3 of 5 steps", or "-" where the run did not say (an older rldiag, another trainer)."""
        known = [v for v in self.rows.get("skipped", pd.Series(dtype=object)) if v is not None and not _isna(v)]
        if not known:
            return "-"
        n, skipped = len(self.rows), sum(1 for v in known if v >= 0.5)
        part = "" if len(known) == n else f" (said at {len(known)} of {n} steps)"
        if skipped == len(known):
            return f"skipped: the weights did not change{part}"
        if skipped == 0:
            return f"stepped on it: the weights took the non-finite update{part}"
        return f"skipped at {skipped} of {len(known)} steps, stepped on the rest{part}"

    @property
    def params_text(self) -> str:
        """What the alerts name: "30 parameter tensors, the same at every step", "2 to 5 parameter tensors
        (7 different)", or "not named (no rldiag alert for these steps)"."""
        named = [p for p, n in zip(self.rows["params"], self.rows["n_params"]) if n is not None and not _isna(n)]
        if not named:
            return "not named (no rldiag alert for these steps)"
        sets = [frozenset(x for x in p.split(", ") if x) for p in named]
        partial = "" if len(named) == len(self.rows) else f" (named at {len(named)} of {len(self.rows)} steps)"
        if len(set(sets)) == 1:
            n = len(sets[0])
            every = "the same at every step" if len(named) > 1 else "at this step"
            return f"{_plural(n, 'parameter tensor')}, {every}{partial}"
        sizes = sorted(len(s) for s in sets)
        return (f"{sizes[0]} to {_plural(sizes[-1], 'parameter tensor')} a step "
                f"({len(frozenset().union(*sets))} different){partial}")

    @property
    def same_params(self) -> bool:
        """Every step names the same parameter tensors (so they can be listed once for the episode)."""
        named = [frozenset(x for x in str(p or "").split(", ") if x) for p in self.rows["params"]]
        return bool(named[0]) and len(set(named)) == 1

    @property
    def params(self) -> list[str]:
        """Every parameter tensor named in the episode, in the order first named."""
        return list(dict.fromkeys(x for p in self.rows["params"] for x in str(p or "").split(", ") if x))

    @property
    def positions_text(self) -> str:
        """The samples whose tokens went non-finite and how many token positions each:
        "micro-batch 1 sample 0: 160 token positions (4 a step)"; "-" when no alert names any."""
        per: dict[str, list[int]] = {}
        for text in self.rows["positions"]:
            for part in str(text or "").split("; "):
                if part:
                    m = _POSITION.match(part)
                    per.setdefault(m["where"], []).append(1 if m["token"] is not None else 0)
        if not per:
            return "-"
        n_steps = len(self.rows)
        parts = []
        for where, toks in list(per.items())[:SHOWN_SAMPLES]:
            n = sum(toks)
            if n == 0:
                parts.append(where)
                continue
            rate = f" ({n // n_steps} a step)" if n_steps > 1 and n % n_steps == 0 else ""
            parts.append(f"{where}: {_plural(n, 'token position')}{rate}")
        if len(per) > SHOWN_SAMPLES:
            parts.append(f"and {len(per) - SHOWN_SAMPLES} more samples")
        return "; ".join(parts)

    @property
    def source_text(self) -> str:
        return ", ".join(dict.fromkeys(str(s) for s in self.rows["source"]))


def _isna(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v)) or v is pd.NA


def _norm_kind(v) -> str:
    v = float(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return "finite"  # grad/finite = 0 with a finite norm (e.g. one NaN element in a clipped sum)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _checked_steps(h: Histories | None, run_id: str) -> np.ndarray:
    """Steps of `run_id` whose gradients were checked (grad/finite or a grad norm logged), sorted."""
    if h is None:
        return np.empty(0, np.int64)
    found = [t.steps for k in (keys.GRAD_FINITE, keys.GRAD_NORM) if (t := h.get(run_id, k)) is not None]
    return np.unique(np.concatenate(found)) if found else np.empty(0, np.int64)


def nan_episodes(events: pd.DataFrame, h: Histories | None = None,
                 run_ids: Sequence[str] | None = None) -> list[Episode]:
    """`events` (nan_events' frame) as episodes, per run in `run_ids` order (default: as they come),
    ascending step; see the module docstring."""
    if events.empty:
        return []
    order = list(run_ids) if run_ids is not None else list(dict.fromkeys(events["run_id"]))
    out = []
    for run_id in order:
        rows = events[events["run_id"] == run_id].sort_values("step", kind="stable").reset_index(drop=True)
        if rows.empty:
            continue
        steps = rows["step"].to_numpy(np.int64)
        checked = _checked_steps(h, run_id)
        bad = set(steps.tolist())
        starts = [0]
        for i in range(1, len(steps)):
            a, b = steps[i - 1], steps[i]
            if len(checked):  # a finite checked step between them ends the stretch
                between = checked[np.searchsorted(checked, a, "right"):np.searchsorted(checked, b, "left")]
                breaks = any(int(s) not in bad for s in between)
            else:
                breaks = b != a + 1
            if breaks:
                starts.append(i)
        for i, j in zip(starts, [*starts[1:], len(steps)]):
            out.append(Episode(run_id, rows.iloc[i:j].reset_index(drop=True)))
    return out


def origin_text(ep: Episode, alerts: dict[str, list[dict]] | None) -> str:
    """Where the episode's NaN entered, as the first alert of its steps that says it (the collectors'
    `origin`: from the loss's backward at these tokens, or the first parameter in backward order); "-"
    where no alert says it."""
    steps = set(ep.steps)
    for event in (alerts or {}).get(ep.run_id, []):
        text = (event.get("origin") or {}).get("text") if isinstance(event.get("origin"), dict) else None
        if text and event.get("step") in steps:
            return str(text)
    return "-"
