"""Runs side by side by step: one matrix per metric, built from the traces' arrays (no pivot)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, NamedTuple

import numpy as np

from rldiag.app.data.trace import Trace


class Aligned(NamedTuple):
    """`values[i, j]` is run `labels[j]` at `steps[i]`; `present` tells a step the run did not log
    (False, value NaN) from a logged NaN (True, value NaN)."""

    steps: np.ndarray  # int64, ascending
    labels: tuple[str, ...]
    values: np.ndarray  # float64, shape (len(steps), len(labels))
    present: np.ndarray  # bool, same shape

    def column(self, label: str) -> np.ndarray:
        return self.values[:, self.labels.index(label)]

    def frame(self):
        """The values as a DataFrame: index `step`, one column per label."""
        import pandas as pd

        return pd.DataFrame(self.values, index=pd.Index(self.steps, name="step"), columns=list(self.labels))

    def delta(self, reference: str) -> Aligned:
        """Each run minus `reference` at the same step (NaN, and not present, where either is missing)."""
        j = self.labels.index(reference)
        both = self.present & self.present[:, [j]]
        with np.errstate(invalid="ignore"):
            d = np.where(both, self.values - self.values[:, [j]], np.nan)
        return Aligned(self.steps, self.labels, d, both)


def align_by_step(traces: Mapping[str, Trace], *, how: Literal["outer", "inner"] = "outer") -> Aligned:
    """Align `{label: trace}` on step: `outer` keeps every step any run logged, `inner` only the steps
    all runs logged."""
    if how not in ("outer", "inner"):
        raise ValueError(f"how={how!r}: use 'outer' or 'inner'")
    labels = tuple(traces)
    if not labels:
        return Aligned(np.empty(0, np.int64), (), np.empty((0, 0)), np.empty((0, 0), bool))
    all_steps = [t.steps for t in traces.values()]
    if how == "outer":
        steps = np.unique(np.concatenate(all_steps))
    else:
        steps = all_steps[0]
        for s in all_steps[1:]:
            steps = np.intersect1d(steps, s, assume_unique=True)
    values = np.full((len(steps), len(labels)), np.nan)
    present = np.zeros((len(steps), len(labels)), bool)
    for j, t in enumerate(traces.values()):
        pos = np.searchsorted(steps, t.steps)
        ok = pos < len(steps)
        ok[ok] = steps[pos[ok]] == t.steps[ok]
        values[pos[ok], j] = t.values[ok]
        present[pos[ok], j] = True
    return Aligned(steps, labels, values, present)
