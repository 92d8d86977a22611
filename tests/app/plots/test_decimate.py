"""Decimation for display: no spike, no NaN, no inf lost; the line is a subset of the real points."""

from __future__ import annotations

import numpy as np
import pytest

from rldiag.app.data.histories import load_histories
from rldiag.app.data.store import open_store
from rldiag.app.plots.decimate import decimate, decimate_trace
from rldiag.collectors import keys
from tests.helpers.runs import write_run


def _window_extremes(steps: np.ndarray, values: np.ndarray, width: float) -> set[int]:
    """Steps whose value is the strict max or min of every point within +-width steps of it.

    Any equal-width bucketing with buckets `width` wide puts such a point's whole bucket inside
    that window, so the point is its bucket's max (min) whatever the bucket edges are.
    """
    out = set()
    lo = np.searchsorted(steps, steps - width, "left")
    hi = np.searchsorted(steps, steps + width, "right")
    for i, (a, b) in enumerate(zip(lo, hi)):
        seg = np.delete(values[a:b], i - a)
        if len(seg) == 0 or values[i] > seg.max() or values[i] < seg.min():
            out.add(int(steps[i]))
    return out


def test_every_bucket_extreme_and_every_nonfinite_point_survives():
    rng = np.random.default_rng(0)
    steps = np.sort(rng.choice(300_000, 100_000, replace=False)).astype(np.int64)  # gaps, irregular
    values = rng.normal(0, 1, len(steps)).cumsum()
    spikes = rng.choice(len(steps), 40, replace=False)
    values[spikes] += rng.choice([-1, 1], 40) * 1e3
    values[[5, 50_000]] = np.nan
    values[777], values[60_000], values[99_999] = np.inf, -np.inf, np.inf
    d = decimate(steps, values, n_out=2000)

    assert len(d.steps) <= 2000 + 2 and d.n_in == 100_000
    finite = np.isfinite(values)
    by_step = dict(zip(steps[finite].tolist(), values[finite].tolist()))
    assert all(by_step[s] == v for s, v in zip(d.steps.tolist(), d.values.tolist()))  # real points only
    assert np.all(np.diff(d.steps) > 0) and np.isfinite(d.values).all()
    assert d.nan_steps.tolist() == steps[[5, 50_000]].tolist()
    assert d.posinf_steps.tolist() == steps[[777, 99_999]].tolist() and d.neginf_steps.tolist() == [steps[60_000]]
    kept = set(d.steps.tolist())
    fs, fv = steps[finite], values[finite]
    assert {int(fs[0]), int(fs[-1])} <= kept  # the line reaches both ends
    assert set(steps[spikes].tolist()) <= kept  # every injected spike
    width = (fs[-1] - fs[0]) / 1000  # 1000 buckets
    assert _window_extremes(fs, fv, width) <= kept


def test_short_traces_pass_through_and_bad_input_is_refused():
    d = decimate(np.arange(5), np.array([1.0, np.nan, 3.0, -np.inf, 5.0]), n_out=100)
    assert d.steps.tolist() == [0, 2, 4] and d.values.tolist() == [1.0, 3.0, 5.0]
    assert d.nan_steps.tolist() == [1] and d.neginf_steps.tolist() == [3] and d.posinf_steps.tolist() == []
    all_nan = decimate(np.arange(3), np.full(3, np.nan))
    assert len(all_nan.steps) == 0 and all_nan.nan_steps.tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="n_out=3"):
        decimate(np.arange(10), np.zeros(10), n_out=3)
    with pytest.raises(ValueError, match="same length"):
        decimate(np.arange(10), np.zeros(9))


def test_decimating_a_loaded_trace_keeps_its_nan_step(store_uri):
    rid = write_run(store_uri, steps=[(s, {keys.GRAD_NORM: float("nan") if s == 1234 else 1.0 + (s == 3000) * 50})
                                      for s in range(5000)])
    trace = load_histories(open_store(store_uri), [rid], [keys.GRAD_NORM]).get(rid, keys.GRAD_NORM)
    d = decimate_trace(trace, n_out=100)
    assert len(d.steps) <= 102 and d.nan_steps.tolist() == [1234] and 3000 in d.steps.tolist()
    part = decimate_trace(trace, n_out=100, first=2000, last=4000)
    assert part.steps[0] == 2000 and part.steps[-1] == 4000 and part.nan_steps.tolist() == []
