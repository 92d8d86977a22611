"""Run colours: one per run, from the run (not its place in the picked list), candidates never grey.

PALETTE is Okabe-Ito's six colours for colour-blind readers, then six picked to stay apart from them
and each other: any two of the 12 are at least 20 CIEDE2000 apart (the old palette's olive and
yellow were 10), each at least 20 from every reference grey and 25 from the white background
(tests/app/plots/test_colors.py measures them). References take black and greys, candidates never do.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

REFERENCE_COLOR = "#111111"
PALETTE = ("#E69F00", "#56B4E9", "#009E73", "#D55E00", "#CC79A7", "#0072B2",
           "#8800DD", "#BB0033", "#99BB00", "#336600", "#775500", "#9988FF")
REFERENCE_GREYS = (REFERENCE_COLOR, "#555555", "#888888", "#AAAAAA")


def run_order(runs) -> list[str]:
    """Run ids oldest first (start time, then id): the order `run_colors` reads a run's colour from.
    `runs`: a DataFrame with `run_id` and `start_time` columns, every run of the experiment(s) (the
    dashboard's run list, the report's search), so that a run keeps its colour whatever is picked."""
    if runs is None or not len(runs):
        return []
    import pandas as pd

    # datetimes (find_runs) or epoch numbers (a raw search): only their order matters
    t = runs["start_time"]
    t = t if pd.api.types.is_datetime64_any_dtype(t) else pd.to_datetime(t, unit="ms", utc=True, errors="coerce")
    df = pd.DataFrame({"run_id": runs["run_id"].to_numpy(), "t": t.to_numpy()})
    return df.sort_values(["t", "run_id"], kind="stable", na_position="first")["run_id"].tolist()


def _hash_slot(run_id: str) -> int:
    """A palette slot from the run id alone (a stable hash, the same in every process)."""
    return int(hashlib.sha1(run_id.encode()).hexdigest()[:8], 16)


def run_colors(run_ids: Sequence[str], reference_ids: Sequence[str] = (), *,
               order: Sequence[str] | None = None) -> dict[str, str]:
    """A colour per run that follows the run, not its place in the picked list: a candidate takes the
    palette colour of its place in `order` (every run of its experiment, oldest first: `run_order`);
    references take black and greys in that order. A run not in `order` (or no `order`): a stable hash
    of its id. Two picked candidates whose places share a colour (12 apart): the later one takes the
    next colour no picked candidate has, so up to 12 candidates are always told apart. The dashboard
    and the report pass the same order, so a run has one colour in both."""
    refs = set(reference_ids)
    place = {r: i for i, r in enumerate(order or ())}

    def rank(r: str) -> tuple:
        return (r not in place, place.get(r, 0), r)

    ref_ids = sorted((r for r in dict.fromkeys(run_ids) if r in refs), key=rank)
    colors = {r: REFERENCE_GREYS[i % len(REFERENCE_GREYS)] for i, r in enumerate(ref_ids)}
    used: set[int] = set()
    for r in sorted((r for r in dict.fromkeys(run_ids) if r not in refs), key=rank):
        slot = (place[r] if r in place else _hash_slot(r)) % len(PALETTE)
        if len(used) < len(PALETTE):
            while slot in used:
                slot = (slot + 1) % len(PALETTE)
        used.add(slot)
        colors[r] = PALETTE[slot]
    return {r: colors[r] for r in run_ids}
