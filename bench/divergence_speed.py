"""Divergence speed at the dashboard's size: `compare_runs` for 9 candidates x 8 metrics of 100k steps.

    python -m bench.divergence_speed           # quick (also --quick): 3 references, 3 candidates x 2 metrics
                                               # (writes bench/results/divergence_speed_quick.json)
    python -m bench.divergence_speed --full --repeats 2   # 9 candidates x 8 metrics, 1 and 3 references

The runs are in memory (no store: this times the detection, not the reading): per metric an AR(1)
noise (phi 0, 0.3, 0.6 or 0.85) with Student-t innovations, spikes, and for half the metrics a positive
log-normal series (compared as logs); candidates with no change, a 3-sd shift from step 50k, a variance
change, NaN from step 70k. Each case starts with the reference model's cache cleared (a cold start, as
the dashboard's first load has it). `fingerprint` hashes every verdict (status, kind, onset, alert,
end of every departure, sizes to 6 digits): a speed change must leave it as it was. `--before REV`
times `compare_runs` as commit REV had it (its detector and divergence modules, read with git) on the
same runs in the same process, alternating with the current one, and says whether both give the same
verdicts, or on how many pairs the status is the same (default: 085405d, the detector before the
speed-up; `--before none` skips it). The detector's verdicts have changed since on purpose (its
calibration on RL-like noise: a variance alarm on a no-change candidate is gone, departures are placed
differently), so the ratio is a speed figure against that revision, not a check of sameness.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from scipy.signal import lfilter

from bench._common import env_info, summary_row, write_result
from rldiag.app.analysis.detector import reference_model
from rldiag.app.analysis.divergence import DivergenceConfig, compare_runs
from rldiag.app.data.histories import Histories
from rldiag.app.data.trace import Trace

N_STEPS = 100_000
ROOT = Path(__file__).resolve().parent.parent
BEFORE_REV = "085405d"  # the detector before the rolling medians were sped up


def _series(rng: np.random.Generator, n: int, phi: float, positive: bool) -> np.ndarray:
    e = rng.standard_t(5, n) / np.sqrt(5 / 3) * np.sqrt(1 - phi**2)
    x = lfilter([1.0], [1.0, -phi], e)
    spikes = rng.random(n) < 1 / 200
    x[spikes] += rng.choice([-1, 1], spikes.sum()) * rng.uniform(4, 30, spikes.sum())
    return np.exp(-2 + 0.4 * x) if positive else 10 + x


def histories(n_refs: int, n_cands: int, n_keys: int, n: int = N_STEPS, seed: int = 0,
              drift: bool = False) -> tuple[Histories, list, list]:
    """In-memory histories: `n_refs` reference seeds and `n_cands` candidates, `n_keys` metrics of `n` steps;
    `drift`: every run also wanders as a random walk of its own (steps of 0.5 noise sd: seeds that part by
    hundreds of sd over 100k steps, each candidate far from its reference most of the time)."""
    rng = np.random.default_rng(seed)
    steps = np.arange(n, dtype=np.int64)
    refs = [f"ref{j}" for j in range(n_refs)]
    cands = [f"cand{j}" for j in range(n_cands)]
    traces = {}
    for k in range(n_keys):
        key, phi, positive = f"m{k}", (0.0, 0.3, 0.6, 0.85)[k % 4], k % 2 == 1
        for run in refs + cands:
            v = _series(rng, n, phi, positive)
            if drift:
                walk = np.cumsum(rng.normal(0, 0.5, n))
                v = v * np.exp(0.4 * walk) if positive else v + walk
            j = cands.index(run) if run in cands else -1
            change = j % 4 if j >= 0 else -1  # 0 none, 1 shift, 2 variance, 3 NaN
            if change == 1:
                v = v * np.exp(3 * 0.4) if positive else v + 3
                v[: n // 2] = _series(rng, n // 2, phi, positive)
            elif change == 2:
                v[n // 2:] += rng.normal(0, 3 * (0.05 if positive else 1), n - n // 2)
                v = np.abs(v) if positive else v
            elif change == 3:
                v[int(0.7 * n):] = np.nan
            traces[(run, key)] = Trace(run, key, key, steps, v, steps)
    h = Histories("sqlite:///unused.db", "sql", traces, tuple(refs + cands), {}, {}, {})
    return h, refs, cands


def fingerprint(found: dict) -> str:
    """A hash of every verdict: status, each departure's kind, steps and sizes (6 significant digits)."""
    lines = []
    for key in sorted(found):
        for cand in sorted(found[key]):
            d = found[key][cand]
            lines.append(f"{key} {cand} {d.status} {d.steps_compared} {d.first_nonfinite_step} {d.detectable:.6g}")
            lines += [f"  {x.kind} {x.onset_step} {x.alert_step} {x.end_step} {x.candidate:.6g} {x.reference:.6g} "
                      f"{x.delta:.6g} {x.delta_sigma:.6g}" for x in d.departures]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def before_modules(rev: str):
    """(compare_runs, reference_model, DivergenceConfig) as commit `rev` had them, loaded from git."""
    mods = load_rev(rev)
    return mods["divergence"].compare_runs, mods["detector"].reference_model, mods["divergence"].DivergenceConfig


def load_rev(rev: str) -> dict:
    """The detector and divergence modules as commit `rev` had them, loaded from git with every module of
    app/analysis at `rev` beside them (a package `_before_analysis`: since the detector's split, 02d0990, its
    parts are modules of their own, which a copy of detector.py alone would take from the current tree)."""
    tmp = Path(tempfile.mkdtemp(prefix="rldiag-before-"))
    pkg = tmp / "_before_analysis"
    pkg.mkdir()
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:app/analysis"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    for name in (n for n in names if n.endswith(".py")):
        src = subprocess.run(["git", "show", f"{rev}:app/analysis/{name}"], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout
        (pkg / name).write_text(src.replace("rldiag.app.analysis", "_before_analysis"))
    sys.path.insert(0, str(tmp))
    try:
        return {name: importlib.import_module(f"_before_analysis.{name}") for name in ("detector", "divergence")}
    finally:
        sys.path.remove(str(tmp))


def _timed(compare, ref_model, config, h, refs, cands) -> tuple[float, dict]:
    ref_model.cache_clear()  # cold: the dashboard's first load computes every reference model
    t0 = time.perf_counter()
    found = compare(h, refs, cands, config=config)
    return time.perf_counter() - t0, found


def time_case(n_refs: int, n_cands: int, n_keys: int, repeats: int = 1, before=None, drift: bool = False) -> dict:
    h, refs, cands = histories(n_refs, n_cands, n_keys, drift=drift)
    took, took_before, prints_before, found_b = [], [], set(), {}
    for _ in range(repeats):
        if before is not None:  # alternate, so that both see the same load on a shared machine
            t, found_b = _timed(before[0], before[1], before[2](), h, refs, cands)
            took_before.append(t)
            prints_before.add(fingerprint(found_b))
        t, found = _timed(compare_runs, reference_model, DivergenceConfig(), h, refs, cands)
        took.append(t)
    diverged = sum(d.diverged for by in found.values() for d in by.values())
    out = {"seconds": min(took), "all": took, "pairs": n_cands * n_keys, "diverged": diverged,
           "fingerprint": fingerprint(found)}
    if before is not None:
        same_status = sum(found_b[k][c].status == d.status for k, by in found.items() for c, d in by.items())
        out |= {"before_seconds": min(took_before), "before_all": took_before,
                "same_verdicts": prints_before == {out["fingerprint"]}, "same_status": same_status}
    return out


def verdicts_said(r: dict, rev: str) -> str:
    """How the verdicts compare with commit `rev`'s: the same, or on how many pairs the status is."""
    if r["same_verdicts"]:
        return "same verdicts"
    return f"verdicts not the same ({rev}'s detector has changed since): same status on {r['same_status']} of {r['pairs']} pairs"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="9 candidates x 8 metrics, 1 and 3 references")
    ap.add_argument("--repeats", type=int, default=1, help="timed repeats per case (the fastest is kept)")
    ap.add_argument("--quick", action="store_true", help="the default: 3 candidates x 2 metrics")
    ap.add_argument("--before", metavar="REV", default=BEFORE_REV,
                    help=f"also time compare_runs as git commit REV had it (default {BEFORE_REV}; none: skip)")
    args = ap.parse_args(argv)
    args.before = None if args.before in ("", "none") else args.before
    before = before_modules(args.before) if args.before else None
    # drifting runs: impulse cleaning made them 9x slower (3e5f29a) while the stationary cases did not move
    cases = ({"1 reference": (1, 9, 8, False), "3 references": (3, 9, 8, False),
              "1 reference, drifting": (1, 9, 8, True)} if args.full
             else {"3 references": (3, 3, 2, False), "1 reference, drifting": (1, 3, 2, True)})
    res = {}
    for name, (r, c, k, drift) in cases.items():
        res[name] = r = time_case(r, c, k, args.repeats, before, drift)
        extra = (f"  before ({args.before}) {r['before_seconds']:7.2f} s, {r['before_seconds'] / r['seconds']:.1f}x,"
                 f" {verdicts_said(r, args.before)}" if before else "")
        print(f"{name:22} {r['pairs']:3} pairs  {r['seconds']:7.2f} s  {r['diverged']} diverged  "
              f"verdicts {r['fingerprint']}{extra}")
    summary = []
    for name, r in res.items():
        size = f"{r['pairs'] // (8 if args.full else 2)} candidates x {8 if args.full else 2} metrics x 100k steps"
        alt = f"before ({args.before}): {r['before_seconds']:.2f} s" if before else "-"
        ratio = f"{r['before_seconds'] / r['seconds']:.1f}x faster, {verdicts_said(r, args.before)}" if before else "-"
        summary.append(summary_row(f"divergence, {size}, {name} (cold)", f"{r['seconds']:.2f} s", alt, ratio,
                                   "-", None))
    # the quick default writes its own file: the table's row (divergence_speed.json) is the --full run's
    write_result("divergence_speed" if args.full else "divergence_speed_quick", {"env": env_info(), "quick": not args.full, "n_steps": N_STEPS,
                                      "before": args.before, "cases": res, "summary": summary})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
