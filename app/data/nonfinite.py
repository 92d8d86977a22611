"""NaN, +inf and -inf as the store holds them, told apart again.

MLflow's SQL stores keep NaN (`is_nan=1`) but clamp +-inf to +-max-float with no flag. So a value of
exactly +-1.7976931348623157e308 is read as +-inf; rldiag's writer also logs `rldiag/inf/<key>` = +-1
at the same step and timestamp (`rldiag.collectors.keys.inf_flag_key`), which restores inf where a store
kept some other finite stand-in.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

MAX_FLOAT = float(np.finfo(np.float64).max)  # 1.7976931348623157e308, MLflow's stand-in for inf


class NonFinite(NamedTuple):
    """Steps (int64 arrays, ascending) where a trace is NaN, +inf and -inf."""

    nan: np.ndarray
    posinf: np.ndarray
    neginf: np.ndarray

    @property
    def count(self) -> int:
        return len(self.nan) + len(self.posinf) + len(self.neginf)

    @property
    def first_step(self) -> int | None:
        """The first non-finite step, or None."""
        firsts = [int(a[0]) for a in self if len(a)]
        return min(firsts) if firsts else None


def restore_infinities(
    steps: np.ndarray,
    timestamps: np.ndarray,
    values: np.ndarray,
    flags: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
) -> np.ndarray:
    """`values` with +-max-float turned into +-inf, and flagged points set to +-inf.

    `flags` = (steps, timestamps, signs) of the key's `rldiag/inf/` companion. A flag applies only to
    the point logged with the same step and timestamp: a later rewrite of that step keeps its value.
    """
    out = np.where(values == MAX_FLOAT, np.inf, np.where(values == -MAX_FLOAT, -np.inf, values))
    if flags is not None and len(flags[0]) and len(steps):
        f_steps, f_ts, f_sign = flags
        pos = np.searchsorted(steps, f_steps)  # `steps` is sorted and unique
        pos = np.minimum(pos, len(steps) - 1)
        hit = (steps[pos] == f_steps) & (timestamps[pos] == f_ts) & (f_sign != 0)
        out[pos[hit]] = np.where(f_sign[hit] > 0, np.inf, -np.inf)
    return out


def nonfinite_steps(steps: np.ndarray, values: np.ndarray) -> NonFinite:
    """Where `values` is NaN, +inf and -inf, as steps."""
    return NonFinite(steps[np.isnan(values)], steps[values == np.inf], steps[values == -np.inf])
