"""Synthetic runs with a known truth, for the divergence tests and the divergence-quality benchmark.

A run: a saturating trend, a per-seed slow wander (AR(1), rho 0.995) and per-step noise (Gaussian,
or Student-t with 5 degrees of freedom for heavy tails), noise sd 1. Seeds of one configuration share
the trend and differ in wander and noise, as real seed replicates do.
"""

from __future__ import annotations

import numpy as np

from rldiag.app.data.trace import Trace

T, ONSET = 1000, 500  # steps per run; where a labelled change starts


def seed_run(seed: int, *, wander: float = 0.3, heavy: bool = False, n: int = T) -> np.ndarray:
    """One run's values (noise sd 1) for `seed`."""
    rng = np.random.default_rng(seed)
    t = np.arange(n)
    noise = rng.standard_t(5, n) / np.sqrt(5 / 3) if heavy else rng.normal(0, 1, n)
    slow = np.zeros(n)
    if wander:
        rho = 0.995
        kicks = rng.normal(0, wander * np.sqrt(1 - rho**2), n)
        slow[0] = rng.normal(0, wander)
        for i in range(1, n):
            slow[i] = rho * slow[i - 1] + kicks[i]
    return 5 + 3 * (1 - np.exp(-t / 300)) + slow + noise


def trace(values: np.ndarray, run: str = "run", steps: np.ndarray | None = None) -> Trace:
    steps = np.arange(len(values), dtype=np.int64) if steps is None else steps
    return Trace(run, "m", "m", steps, np.asarray(values, float), np.zeros(len(values), np.int64))


def refs(seed: int, n_seeds: int, **kw) -> list[Trace]:
    """`n_seeds` reference replicates for pair number `seed`."""
    return [trace(seed_run(1000 * seed + i, **kw), f"ref{i}") for i in range(n_seeds)]


def apply_change(values: np.ndarray, kind: str, *, onset: int = ONSET, size: float = 3.0, seed: int = 0) -> np.ndarray:
    """`values` with a labelled change from `onset`: level (+size sd), drift (size/100 sd per step),
    variance (noise x (1 + size)), spike (one step of 30 x size sd), nan (NaN from onset on), none."""
    out = values.copy()
    n = len(out) - onset
    if kind == "level":
        out[onset:] += size
    elif kind == "drift":
        out[onset:] += size / 100 * np.arange(n)
    elif kind == "variance":
        out[onset:] += np.random.default_rng(seed + 7).normal(0, size + 1.0, n)
    elif kind == "spike":
        out[onset] += 30 * size
    elif kind == "nan":
        out[onset:] = np.nan
    elif kind != "none":
        raise ValueError(f"change kind {kind!r}: use none, level, drift, variance, spike or nan")
    return out
