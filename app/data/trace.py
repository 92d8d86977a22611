"""One run's history of one metric, as numpy arrays: what the loaders build and the charts draw."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from rldiag.app.data.nonfinite import NonFinite, nonfinite_steps, restore_infinities


class RawSeries(NamedTuple):
    """Rows as a store returns them for one (run, logged key): any order, steps may repeat."""

    steps: np.ndarray  # int64
    timestamps: np.ndarray  # int64, milliseconds
    values: np.ndarray  # float64, NaN where the store says NaN, +-max-float where it clamped inf

    @classmethod
    def empty(cls) -> RawSeries:
        return cls(np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.float64))

    @classmethod
    def concat(cls, parts: list[RawSeries]) -> RawSeries:
        parts = [p for p in parts if len(p.steps)]
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return cls.empty()
        return cls(*(np.concatenate(cols) for cols in zip(*parts)))


@dataclass(frozen=True, eq=False)
class Trace:
    """Steps ascending and unique; values with NaN, +inf and -inf told apart.

    `key` is the canonical key (see `rldiag.collectors.keys`), `source_key` the key as the run logged it
    (`grad_norm` for a TRL run's `grad/norm`). Where a step was logged more than once (a resumed
    run), the point with the latest timestamp is kept, as MLflow's own "latest value" does. Where every
    point was logged at one step (`logged_at`: MLflow's 0 when `log_metric` is given no step), the steps
    are the points' logging order, 0, 1, 2, ...
    """

    run_id: str
    key: str
    source_key: str
    steps: np.ndarray  # int64
    values: np.ndarray  # float64
    timestamps: np.ndarray  # int64, milliseconds
    logged_at: int | None = None  # the one step every point was logged at (steps are then the logging order); None: as logged

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def last_step(self) -> int | None:
        return int(self.steps[-1]) if len(self.steps) else None

    def nonfinite(self) -> NonFinite:
        """The steps where this trace is NaN, +inf, -inf."""
        return nonfinite_steps(self.steps, self.values)

    def between(self, first: int | None = None, last: int | None = None) -> Trace:
        """The part with `first <= step <= last` (either bound may be None)."""
        lo = 0 if first is None else int(np.searchsorted(self.steps, first, "left"))
        hi = len(self.steps) if last is None else int(np.searchsorted(self.steps, last, "right"))
        return Trace(self.run_id, self.key, self.source_key, self.steps[lo:hi], self.values[lo:hi],
                     self.timestamps[lo:hi], self.logged_at)

    def at(self, steps: np.ndarray) -> np.ndarray:
        """The values at `steps` (NaN where this trace has no point), vectorised."""
        out = np.full(len(steps), np.nan)
        if not len(self.steps):
            return out
        pos = np.minimum(np.searchsorted(self.steps, steps), len(self.steps) - 1)
        hit = self.steps[pos] == steps
        out[hit] = self.values[pos[hit]]
        return out

    def as_raw(self) -> RawSeries:
        """The points as the store holds them (at `logged_at`, where that is set)."""
        steps = self.steps if self.logged_at is None else np.full(len(self.steps), self.logged_at, np.int64)
        return RawSeries(steps, self.timestamps, self.values)


MIN_ORDER_POINTS = 3  # points at one step that make a series logged without steps (two: a step logged twice)


def build_trace(run_id: str, key: str, source_key: str, raw: RawSeries, flags: RawSeries | None = None) -> Trace:
    """Sort `raw` by step, keep the latest point per step, and restore infinities (see `rldiag.app.data.nonfinite`).

    `flags` are the rows of the `rldiag/inf/<source_key>` companion, if any. A series of MIN_ORDER_POINTS or
    more points all at one step (a loop that called `mlflow.log_metric` with no step: MLflow logs 0) is
    kept whole, its steps its logging order (by timestamp; points of the same millisecond in the store's
    row order), `logged_at` that step: keeping the latest point would leave one of them.
    """
    steps = np.asarray(raw.steps, np.int64)
    ts = np.asarray(raw.timestamps, np.int64)
    values = np.asarray(raw.values, np.float64)
    if len(steps) >= MIN_ORDER_POINTS and (steps == steps[0]).all():
        order = np.argsort(ts, kind="stable")
        ts, values = ts[order], values[order]
        by_order = np.arange(len(ts), dtype=np.int64)  # no inf flags: rldiag's writer always logs a step
        return Trace(run_id, key, source_key, by_order, restore_infinities(by_order, ts, values), ts, int(steps[0]))
    if len(steps) > 1 and not (steps[1:] > steps[:-1]).all():  # already in order, one row a step: as logged
        order = np.lexsort((values, ts, steps))  # by step, then timestamp, then value
        steps, ts, values = steps[order], ts[order], values[order]
        last = np.empty(len(steps), bool)
        last[:-1] = steps[1:] != steps[:-1]
        last[-1] = True
        if not last.all():
            steps, ts, values = steps[last], ts[last], values[last]
    flag_arrays = None
    if flags is not None and len(flags.steps):
        flag_arrays = (np.asarray(flags.steps, np.int64), np.asarray(flags.timestamps, np.int64),
                       np.asarray(flags.values, np.float64))
    values = restore_infinities(steps, ts, values, flag_arrays)
    return Trace(run_id, key, source_key, steps, values, ts)
