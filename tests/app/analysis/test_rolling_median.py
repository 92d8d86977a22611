"""The detector's fast rolling medians give pandas' values exactly (the verdicts must not move)."""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd

from rldiag.app.analysis.rolling_median import rolling_median, row_nanmedian


def test_a_small_trailing_window_by_hand():
    # window 3, at least 2 points: [nan, median(1, 5) = 3, median(1, 5, 2) = 2, median(5, 2, nan) = 3.5,
    # median(2, nan, 4) = 3, median(nan, 4, 9) = 6.5]
    x = np.array([1.0, 5.0, 2.0, np.nan, 4.0, 9.0])
    got = rolling_median(x, 3, center=False, min_periods=2)
    np.testing.assert_array_equal(got, [np.nan, 3.0, 2.0, 3.5, 3.0, 6.5])


def test_equal_to_pandas_on_random_series_with_gaps_and_edges():
    # lengths around the window, odd and even windows, NaN scattered, NaN to the end, +-inf, quantised
    # values (ties): every value must be pandas' own, bit for bit
    rng = np.random.default_rng(7)
    for _ in range(1500):
        n, w = int(rng.integers(1, 400)), int(rng.integers(1, 50))
        center, mp = bool(rng.random() < 0.5), int(rng.integers(1, w + 1))
        x = rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 6) if rng.random() < 0.7 else \
            rng.integers(0, 4, n).astype(float)
        kind = rng.random()
        if kind < 0.3:
            x[rng.random(n) < 0.1] = np.nan
        elif kind < 0.4:
            x[int(rng.integers(0, n)):] = np.nan
        elif kind < 0.5:
            x[rng.random(n) < 0.05] = rng.choice([np.inf, -np.inf])
        want = pd.Series(x).rolling(w, center=center, min_periods=mp).median().to_numpy()
        got = rolling_median(x, w, center=center, min_periods=mp)
        assert np.array_equal(want, got, equal_nan=True), (n, w, center, mp)


def test_many_scattered_gaps_and_columns():
    rng = np.random.default_rng(8)
    x = rng.standard_normal((5000, 3))
    x[rng.random(x.shape) < 0.2] = np.nan  # thousands of NaN-touched stretches: the one-pass fallback
    for w, center in ((9, True), (65, True), (129, False)):
        want = pd.DataFrame(x).rolling(w, center=center, min_periods=w // 2 + 1).median().to_numpy()
        assert np.array_equal(want, rolling_median(x, w, center=center, min_periods=w // 2 + 1), equal_nan=True)


def test_row_nanmedian_is_numpys():
    rng = np.random.default_rng(9)
    for cols in (1, 2, 3, 4, 5):
        a = rng.standard_normal((3000, cols))
        a[rng.random(a.shape) < 0.3] = np.nan  # some rows all NaN
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            want = np.nanmedian(a, axis=1)
        assert np.array_equal(want, row_nanmedian(a), equal_nan=True)


def test_without_scipy_the_values_are_the_same(monkeypatch):
    """An install without scipy (the training side's [hf] next to TRL 1.1, where the watcher runs in
    `make test`) takes pandas' path for every window: the same medians, NaN included."""
    from rldiag.app.analysis import rolling_median as rm

    x = np.random.default_rng(7).standard_t(3, 5000)
    x[[10, 11, 2500]] = np.nan
    with_scipy = [rm.rolling_median_1d(x, w, center=c, min_periods=w // 2) for w in (11, 21, 129) for c in (True, False)]
    monkeypatch.setattr(rm, "median_filter", None)
    without = [rm.rolling_median_1d(x, w, center=c, min_periods=w // 2) for w in (11, 21, 129) for c in (True, False)]
    for a, b in zip(with_scipy, without):
        np.testing.assert_array_equal(a, b)
