"""Divergence on metric families the labelled set (`bench.divergence_rl`) does not have: counts, rates of
k in N tokens, rewards of k/8, metrics often exactly 0 (signed too), metrics that die to 0; and the
labelled set's metrics with the candidate logged more sparsely than its references (or the reverse).

    python -m bench.divergence_probes                    # ~1 minute; also the detector of --before
    python -m bench.divergence_probes --before none      # this detector only

Each probe is 40 comparisons per reference count (1, 2, 3), each with its own seeds; a no-change probe
counts the candidates flagged (every one a false alarm), a change probe the changes found at or after
their start. `--before REV` (default fdf590b, the detector before the two-part comparison and the
jitter) scores the same comparisons with commit REV's detector (its app/analysis modules, read with
git), so each figure has its "before" beside it. Results: bench/results/divergence_probes.json.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
from tqdm import tqdm

from bench._common import env_info, summary_row, write_result
from bench.divergence_data import trace
from bench.divergence_rl import every, scenario
from rldiag.app.analysis.divergence import detect_divergence
from rldiag.app.data.trace import Trace

N, T, REFS = 40, 400, (1, 2, 3)
BEFORE = "fdf590b"


def _wander(r: np.random.Generator) -> np.ndarray:
    return 0.5 * np.convolve(r.standard_normal(T + 9), np.ones(10) / 10, "valid")[:T]


def _ar(r: np.random.Generator, phi: float, sd: float) -> np.ndarray:
    x = np.zeros(T)
    for i in range(1, T):
        x[i] = phi * x[i - 1] + r.normal(0, sd)
    return x


# no-change families: (draw one run) -> values; salt: the seeds' third number
NO_CHANGE: dict[str, tuple[Callable, int]] = {
    "count 1 + Poisson(0.3)": (lambda r: 1.0 + r.poisson(0.3, T), 21),
    "clip rate k/200 at 0.2% per token (67% zeros)": (lambda r: r.binomial(200, 0.002, T) / 200, 21),
    "the same with a slow wander": (lambda r: r.binomial(200, np.clip(0.002 * np.exp(_wander(r)), 0, 1)) / 200, 21),
    "reward: mean of 8 pass/fail at p 0.1 (43% zeros)": (lambda r: r.binomial(8, 0.1, T) / 8, 21),
    "reward: mean of 8 pass/fail at p 0.5": (lambda r: r.binomial(8, 0.5, T) / 8, 21),
    "accuracy of 64 samples at 0.9": (lambda r: r.binomial(64, 0.9, T) / 64, 21),
}


def clip_seeded(r: np.random.Generator) -> np.ndarray:
    """A clip rate of k/200 whose per-token rate differs by seed (a factor of about 1.35 per sd) and wanders."""
    q = 0.002 * np.exp(0.3 * r.standard_normal() + _wander(r))
    return r.binomial(200, np.clip(q, 0, 1)) / 200


def grpo_loss(r: np.random.Generator, rate: float = 0.3) -> np.ndarray:
    """A GRPO-like loss: N(0, 0.01), exactly 0 at the steps where no group has an advantage."""
    x = r.normal(0, 0.01, T)
    x[r.random(T) < rate] = 0.0
    return x


def _collapse(c: np.ndarray, r: np.random.Generator) -> np.ndarray:
    c = c.copy()
    c[200:] = 0.0
    return c


def _third(c: np.ndarray, r: np.random.Generator) -> np.ndarray:
    c = c.copy()
    c[200:] /= 3
    return c


def _more_zeros(c: np.ndarray, r: np.random.Generator) -> np.ndarray:
    return np.r_[c[:200], grpo_loss(r, 0.7)[200:]]


def _plus_two(c: np.ndarray, r: np.random.Generator) -> np.ndarray:
    c = c.copy()
    c[200:] += 2.0
    return c


# change probes: (family, change applied to the candidate from step 200, salt)
CHANGES: dict[str, tuple[Callable, Callable, int]] = {
    "clip rate k/200, seeds apart: no change": (clip_seeded, None, 11),
    "clip rate k/200, seeds apart: dies to 0 at step 200": (clip_seeded, _collapse, 11),
    "clip rate k/200, seeds apart: a 3x drop": (clip_seeded, _third, 11),
    "GRPO loss, 30% zeros: no change": (grpo_loss, None, 51),
    "GRPO loss, 30% zeros: 70% zeros from step 200": (grpo_loss, _more_zeros, 51),
    "count 1 + Poisson(0.3): +2 from step 200": (lambda r: 1.0 + r.poisson(0.3, T), _plus_two, 8),
}


def _probe(detect, draw, change, salt: int) -> list[int]:
    """Per reference count: no change, candidates flagged; a change, changes found at or after step 200."""
    out = []
    for n_refs in REFS:
        hits = 0
        for seed in range(N):
            rng = np.random.default_rng([seed, n_refs, salt])
            refs = [trace(draw(rng), f"r{j}") for j in range(n_refs)]
            c = draw(rng)
            if change is None:
                hits += detect(refs, trace(c)).diverged
            else:
                d = detect(refs, trace(change(c, rng)))
                hits += bool(d.diverged and d.alert_step >= 200)
        out.append(hits)
    return out


def _with_zeros(t: Trace, seed: int, j: int, offset: float) -> Trace:
    v = t.values.copy() - offset
    v[np.random.default_rng([seed, j, 77]).random(len(v)) < 0.3] = 0.0
    return Trace(t.run_id, t.key, t.source_key, t.steps, v, t.timestamps)


def _linear_with_zeros(detect, offset: float) -> tuple[int, int]:
    """bench.divergence_rl's linear metrics (seeds 0-39) with 30% exact zeros put in, `offset` subtracted
    (10: centred at 0, signed): wrong verdicts (a flag on no change or spikes; a miss or an early alert on
    3 and 5 sd, variance, from step 0) and comparisons."""
    wrong = total = 0
    for change in ("none", "spikes", "level3", "level5", "variance", "from0"):
        for seed in range(40):
            s = scenario(seed, change)
            if s.positive:
                continue
            refs = [_with_zeros(r, seed, j, offset) for j, r in enumerate(s.references)]
            d = detect(refs, _with_zeros(s.candidate, seed, 99, offset))
            total += 1
            wrong += _wrong(d, s)
    return wrong, total


def _wrong(d, s) -> bool:
    """A flag on no change; a miss or an alert before the change on a change."""
    return d.diverged if s.onset is None else (not d.diverged or d.alert_step < s.onset)


def _sparse(detect, cand_every: int, refs_every: int) -> tuple[int, int]:
    """bench.divergence_rl (seeds 0-39, every metric) with the candidate logged every `cand_every`-th step
    and the references every `refs_every`-th (a run with `logging_steps=5` beside ones that log every
    step): wrong verdicts, as `_linear_with_zeros` counts them, and comparisons."""
    wrong = total = 0
    for change in ("none", "spikes", "level3", "level5", "variance", "from0"):
        for seed in range(40):
            s = scenario(seed, change)
            d = detect([every(r, refs_every) for r in s.references], every(s.candidate, cand_every))
            total += 1
            wrong += _wrong(d, s)
    return wrong, total


def run(detect) -> dict:
    out = {}
    for name, (draw, salt) in tqdm(NO_CHANGE.items(), desc="no-change probes", unit="probe"):
        out[name] = {"flagged": _probe(detect, draw, None, salt)}
    for name, (draw, change, salt) in tqdm(CHANGES.items(), desc="change probes", unit="probe"):
        out[name] = {"flagged" if change is None else "found": _probe(detect, draw, change, salt)}
    for offset, name in ((10.0, "divergence_rl linear metrics, 30% zeros, centred at 0"),
                         (0.0, "divergence_rl linear metrics, 30% zeros, at 10")):
        wrong, total = _linear_with_zeros(detect, offset)
        out[name] = {"wrong": wrong, "of": total}
    for c_every, r_every in ((5, 1), (2, 1), (1, 5)):
        wrong, total = _sparse(detect, c_every, r_every)
        out[f"divergence_rl, candidate logged every {c_every}, references every {r_every} step(s)"] = {
            "wrong": wrong, "of": total}
    return out


def _fmt(r: dict) -> str:
    if "wrong" in r:
        return f"{r['wrong']} wrong of {r['of']}"
    key = "flagged" if "flagged" in r else "found"
    return f"{key} " + "/".join(map(str, r[key])) + f" of {N} (1/2/3 references)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default=BEFORE, metavar="REV",
                    help=f"also score with commit REV's detector (default {BEFORE}; 'none': skip)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    now = run(detect_divergence)
    before = None
    if args.before != "none":
        from bench.divergence_speed import load_rev

        before = run(load_rev(args.before)["divergence"].detect_divergence)
    took = time.perf_counter() - t0
    summary = []
    for name, r in now.items():
        b = f"{args.before}: {_fmt(before[name])}" if before else "-"
        print(f"{name}: {_fmt(r)}" + (f"  ({b})" if before else ""))
        summary.append(summary_row(f"divergence probe: {name}", _fmt(r), b, "-", "-", None))
    write_result("divergence_probes", {"env": env_info(), "seconds": took, "before_rev": args.before,
                                       "now": now, "before": before, "summary": summary})
    print(f"\n{took:.1f} s; written bench/results/divergence_probes.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
