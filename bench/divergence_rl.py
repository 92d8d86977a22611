"""RL-like labelled runs for the divergence detector: the noise real RL curves have, and known changes.

Each scenario is one metric of one comparison: reference seeds and a candidate, built from one
configuration. What every run carries (references and candidates alike), drawn per scenario:
- a trend (saturating rise or decay, scale of a few noise sd) shared by the seeds of the configuration;
- per-step noise of marginal sd 1 that is autocorrelated (AR(1), phi drawn from 0 to 0.85) with
  Student-t innovations (3 to 30 degrees of freedom, or Gaussian);
- isolated spikes (about 1 in 200 steps, 4 to 30 sd, either sign) and bursts (2 to 4 consecutive steps
  at 3 to 8 sd, about one a run);
- per-seed slow wander (AR(1) with phi 0.995) and a per-seed level offset, up to 0.35 noise sd each;
- for positive heavy-tailed metrics (KL, clip rate, grad norm), the whole series is exp() of such a
  curve: the noise is right-skewed and grows with the level, as those metrics' noise does; the size of
  a change is then counted in sd of the log;
- with `zeros=True` (`bench.divergence_quality --zeros`), exact zeros in half of those positive metrics,
  drawn apart from the rest (so every other value is the same as without them): 0 at the first step of
  every run (KL new/old, clip rate on an on-policy first step), or 0 at 20-40% of each run's steps (a
  clip rate that is often 0); with `zeros="often"` (`--zeros often`), every metric is positive and
  exactly 0 at 20-40% of each run's steps.

Candidates: a seed of the same configuration (no change), one with three times the isolated spikes, one
still running (cut at a random length), and the changes: level shifts of 2, 3 and 5 sd, a drift, a
variance change, NaN to the end, inf stored as max-float (MLflow's stand-in), and a level shift from
step 0. `make_set(n)` is the set the benchmark and the tests score; its seeds are disjoint from
`bench.divergence_data`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rldiag.app.data.trace import Trace

T, ONSET = 600, 300  # steps per run; where a labelled change starts
MAX_FLOAT = float(np.finfo(np.float64).max)
CHANGES = ("none", "spikes", "running", "level2", "level3", "level5", "drift", "variance", "nan", "inf",
           "from0")
MUST_DETECT = ("level3", "level5", "drift", "variance", "nan", "inf", "from0")  # may not be missed
NO_CHANGE = ("none", "spikes", "running")  # may not fire at all


@dataclass(frozen=True)
class Scenario:
    """One labelled comparison: what it is, its noise, and its runs."""

    change: str
    onset: int | None  # first changed step; None for no change
    phi: float
    dof: float
    positive: bool
    zeros: str  # "none", "first" (each run's step 0 is 0) or "often" (20-40% of each run's steps)
    n_refs: int
    references: tuple[Trace, ...]
    candidate: Trace
    seed: int  # scenario(seed, ...) rebuilds it; scenario(seed, "none") is the same candidate unchanged


def _noise(rng: np.random.Generator, n: int, phi: float, dof: float) -> np.ndarray:
    """AR(1) noise of marginal sd 1 with Student-t innovations (dof = inf: Gaussian)."""
    e = rng.standard_normal(n) if not np.isfinite(dof) else rng.standard_t(dof, n) / np.sqrt(dof / (dof - 2))
    e *= np.sqrt(1 - phi**2)
    x = np.empty(n)
    x[0] = rng.standard_normal()
    for i in range(1, n):
        x[i] = phi * x[i - 1] + e[i]
    return x


def _outliers(rng: np.random.Generator, n: int, rate: float = 1 / 200, bursts: float = 1.0) -> np.ndarray:
    """Isolated spikes and short bursts, added to a run (zero elsewhere)."""
    out = np.zeros(n)
    for i in np.flatnonzero(rng.random(n) < rate):
        out[i] += rng.choice([-1, 1]) * rng.uniform(4, 30)
    for _ in range(rng.poisson(bursts)):
        start, length = int(rng.integers(0, n)), int(rng.integers(2, 5))
        out[start:start + length] += rng.choice([-1, 1]) * rng.uniform(3, 8)
    return out


def _wander(rng: np.random.Generator, n: int, sd: float) -> np.ndarray:
    rho = 0.995
    kicks = rng.normal(0, sd * np.sqrt(1 - rho**2), n)
    w = np.empty(n)
    w[0] = rng.normal(0, sd)
    for i in range(1, n):
        w[i] = rho * w[i - 1] + kicks[i]
    return w


def _trace(values: np.ndarray, run: str, key: str = "m") -> Trace:
    return Trace(run, key, key, np.arange(len(values), dtype=np.int64), np.asarray(values, float),
                 np.zeros(len(values), np.int64))


def scenario(seed: int, change: str, n_refs: int | None = None, zeros: bool | str = False) -> Scenario:
    """The labelled comparison number `seed` with the given change (one of CHANGES). `zeros`: False,
    True (half the positive metrics get exact zeros) or "often" (every metric positive and 0 at 20-40%
    of its steps)."""
    if change not in CHANGES:
        raise ValueError(f"change {change!r}: use one of {', '.join(CHANGES)}")
    rng = np.random.default_rng(10_000 + seed)
    phi = float(rng.choice([0.0, 0.3, 0.6, 0.75, 0.85]))
    dof = float(rng.choice([3.0, 5.0, 30.0, np.inf]))
    positive = bool(rng.random() < 0.4) or zeros == "often"
    n_refs = int(rng.choice([1, 2, 3, 4])) if n_refs is None else n_refs
    wander_sd, offset_sd = rng.uniform(0, 0.35), rng.uniform(0, 0.35)
    t = np.arange(T)
    amp, tau = rng.uniform(-4, 4), rng.uniform(50, 400)
    base = amp * (1 - np.exp(-t / tau))
    log_scale = rng.uniform(0.15, 0.6)  # positive metrics: sd of the log noise
    level = rng.uniform(-4, 1)  # positive metrics: log of the typical value (0.02 to 2.7)

    def run(r: np.random.Generator, extra_spikes: float = 1.0) -> np.ndarray:
        x = base + _wander(r, T, wander_sd) + r.normal(0, offset_sd) + _noise(r, T, phi, dof)
        return x + _outliers(r, T, rate=extra_spikes / 200)

    refs = [run(np.random.default_rng([seed, j])) for j in range(n_refs)]
    cr = np.random.default_rng([seed, 99])
    cand = run(cr, extra_spikes=3.0 if change == "spikes" else 1.0)
    onset: int | None = ONSET
    if change in ("none", "spikes"):
        onset = None
    elif change == "running":
        onset, cand = None, cand[: int(cr.integers(20, T))]
    elif change.startswith("level"):
        cand[ONSET:] += float(change[5:]) * cr.choice([-1, 1])
    elif change == "from0":
        onset = 0
        cand += 5.0 * cr.choice([-1, 1])
    elif change == "drift":
        cand[ONSET:] += cr.choice([-1, 1]) * 0.03 * np.arange(T - ONSET)  # 3 sd after 100 steps
    elif change == "variance":
        cand[ONSET:] += cr.normal(0, 3.0, T - ONSET)  # noise sd 1 -> sqrt(10)

    # zeros from their own generators: the draws above are those of the set without them
    zr = np.random.default_rng([seed, 7, 7])
    kind = str(zr.choice(["none", "first", "often"], p=[0.5, 0.3, 0.2])) if positive and zeros else "none"
    kind = "often" if zeros == "often" else kind
    zero_rate = zr.uniform(0.2, 0.4)

    def finish(x: np.ndarray, j: int) -> np.ndarray:
        if not positive:
            return 10 + x
        v = np.exp(level + log_scale * x)
        if kind == "first":
            v[0] = 0.0
        elif kind == "often":
            v[np.random.default_rng([seed, j, 7]).random(len(v)) < zero_rate] = 0.0
        return v

    refs_v = [finish(r, j) for j, r in enumerate(refs)]
    cand_v = finish(cand, 99)
    if change == "nan":
        cand_v[ONSET:] = np.nan
    elif change == "inf":
        cand_v[ONSET:] = MAX_FLOAT
    return Scenario(change, onset, phi, dof, positive, kind, n_refs,
                    tuple(_trace(r, f"ref{j}") for j, r in enumerate(refs_v)), _trace(cand_v, "cand"), seed)


def every(t: Trace, k: int) -> Trace:
    """Every `k`-th point of a run (a run logged with `logging_steps=k`)."""
    i = np.arange(0, len(t.steps), k)
    return Trace(t.run_id, t.key, t.source_key, t.steps[i], t.values[i], t.timestamps[i])


def make_set(n: int, changes: tuple[str, ...] = CHANGES, first: int = 0, zeros: bool | str = False) -> list[Scenario]:
    """`n` comparisons per change kind (seeds first..first+n-1, each with its own noise draw). The
    defaults were chosen on seeds 0-39: `first=40` scores them on draws they were not chosen on."""
    return [scenario(seed, change, zeros=zeros) for change in changes for seed in range(first, first + n)]
