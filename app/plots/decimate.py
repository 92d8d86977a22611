"""Decimate a trace for display without losing a spike or a NaN.

The finite points go through tsdownsample's MinMax (Rust): the step range is cut into equal-width
buckets and each bucket's minimum and maximum are kept, plus the first and last point. Non-finite
points never enter the line: their steps come back separately, all of them, so that a chart draws
them as markers (MLflow's own charts sample 320 evenly spaced points and lose both).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from rldiag.app.data.trace import Trace

DEFAULT_POINTS = 2000  # per trace: a 1000-pixel chart shows every bucket's min and max


class Decimated(NamedTuple):
    """A line of finite points (subset of the input, ascending steps) and every non-finite step."""

    steps: np.ndarray  # int64
    values: np.ndarray  # float64, all finite
    nan_steps: np.ndarray  # int64, every step whose value is NaN
    posinf_steps: np.ndarray  # int64, every +inf
    neginf_steps: np.ndarray  # int64, every -inf
    n_in: int  # points before decimation


def _minmax_indices(x: np.ndarray, y: np.ndarray, n_buckets: int) -> np.ndarray:
    try:
        from tsdownsample import MinMaxDownsampler
    except ImportError as e:  # pragma: no cover - a core dependency
        raise ImportError("rldiag's charts need tsdownsample: pip install 'tsdownsample>=0.1.4,<0.2'") from e
    return MinMaxDownsampler().downsample(x, y, n_out=2 * n_buckets)


def decimate(steps: np.ndarray, values: np.ndarray, *, n_out: int = DEFAULT_POINTS) -> Decimated:
    """At most about `n_out` line points (`n_out // 2` buckets, each its min and max, plus the ends).

    `steps` must be ascending (as `Trace.steps` are). Buckets are equal-width in step, so a gap in the
    steps stays a gap. Every NaN, +inf and -inf step is returned, however many.
    """
    if n_out < 4:
        raise ValueError(f"n_out={n_out} is too small: use at least 4 (two buckets of min and max)")
    steps = np.ascontiguousarray(steps, np.int64)
    values = np.ascontiguousarray(values, np.float64)
    if steps.shape != values.shape or steps.ndim != 1:
        raise ValueError(f"steps {steps.shape} and values {values.shape} must be 1-d and the same length")
    finite = np.isfinite(values)
    nan_steps = steps[np.isnan(values)]
    posinf_steps = steps[values == np.inf]
    neginf_steps = steps[values == -np.inf]
    fs, fv = (steps, values) if finite.all() else (steps[finite], values[finite])
    if len(fs) > n_out and fs[-1] > fs[0]:
        keep = _minmax_indices(fs, fv, n_out // 2)
        ends = np.array([0, len(fs) - 1], np.int64)
        keep = np.union1d(keep.astype(np.int64), ends)  # sorted, unique: the line reaches both ends
        fs, fv = fs[keep], fv[keep]
    return Decimated(fs, fv, nan_steps, posinf_steps, neginf_steps, len(steps))


def decimate_trace(trace: Trace, *, n_out: int = DEFAULT_POINTS, first: int | None = None,
                   last: int | None = None) -> Decimated:
    """`decimate` of `trace` between steps `first` and `last` (inclusive; None: its ends)."""
    part = trace.between(first, last)
    return decimate(part.steps, part.values, n_out=n_out)
