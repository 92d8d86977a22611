"""Divergence quality on labelled synthetic pairs: false alarms and detection delay, vs a fixed threshold.

    python -m bench.divergence_quality            # 40 pairs per scenario, about a minute
    python -m bench.divergence_quality --quick    # 10 pairs per scenario

Each pair is a reference (3 seed replicates with slow wander, or 1 run without) and a candidate
(`bench.divergence_data`): no change (a seed replicate), or from step 500 a level shift of 3 noise sd,
a drift, a variance change, a single spike, or NaN to the end. For each detector: how many no-change
pairs fire (false alarms, goal 0), how many changed pairs fire before step 500 (early alarms), and the
detection delay (onset found - 500) per kind; goal: median <= 5 steps for the 3-sd level shift.

The baseline is what a dashboard threshold alert does: fire at the first step where the candidate is
more than 3 sd from the references' mean, sd being the reference's point noise (the sd of its
first differences / sqrt 2, which a trend does not inflate).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench._common import env_info, summary_row, write_result
from bench.divergence_data import ONSET, apply_change, refs, seed_run, trace
from rldiag.app.analysis.divergence import detect_divergence

KINDS = ("none", "level", "drift", "variance", "spike", "nan")
EARLY_SLACK = 5  # an onset placed up to 5 steps before the change is the change (a fit's error), not an early alarm
SETUPS = {"3 seeds": dict(n_seeds=3, wander=0.3), "1 run": dict(n_seeds=1, wander=0.0)}


def threshold_onset(references: list, candidate, k: float = 3.0) -> int | None:
    """The baseline: first step with |candidate - mean(references)| > k sd of that difference (or
    non-finite); sd from the references' point noise: sqrt(1 + 1/n) x the sd of one run's first
    differences / sqrt(2)."""
    ref = np.mean([r.values for r in references], axis=0)
    sd = np.std(np.diff(references[0].values)) / np.sqrt(2) * np.sqrt(1 + 1 / len(references))
    with np.errstate(invalid="ignore"):
        bad = ~(np.abs(candidate.values - ref) <= k * sd)
    hits = np.flatnonzero(bad)
    return int(candidate.steps[hits[0]]) if len(hits) else None


def evaluate(pairs: int) -> dict:
    out: dict = {}
    for setup, kw in SETUPS.items():
        n_seeds, wander = kw["n_seeds"], kw["wander"]
        for kind in KINDS:
            res = {"rldiag": [], "threshold-3sd": [], "threshold-5sd": []}
            for seed in range(pairs):
                r = refs(seed, n_seeds, wander=wander)
                c = trace(apply_change(seed_run(1000 * seed + 999, wander=wander), kind, seed=seed))
                d = detect_divergence(r, c)
                res["rldiag"].append(d.onset_step)
                res["threshold-3sd"].append(threshold_onset(r, c, 3.0))
                res["threshold-5sd"].append(threshold_onset(r, c, 5.0))
            row = {}
            for det, onsets in res.items():
                fired = [o for o in onsets if o is not None]
                early = [o for o in fired if o < ONSET - EARLY_SLACK]
                delays = [o - ONSET for o in fired if o >= ONSET - EARLY_SLACK]
                row[det] = {
                    "pairs": pairs,
                    "fired": len(fired),
                    "false_alarms" if kind == "none" else "early_alarms": len(fired) if kind == "none" else len(early),
                    "detected": None if kind == "none" else len(delays),
                    "median_delay": float(np.median(delays)) if delays and kind != "none" else None,
                    "max_delay": int(max(delays)) if delays and kind != "none" else None,
                }
            out[f"{setup}/{kind}"] = row
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=40, help="pairs per scenario (default: 40)")
    ap.add_argument("--quick", action="store_true", help="10 pairs per scenario")
    args = ap.parse_args(argv)
    pairs = 10 if args.quick else args.pairs
    t0 = time.perf_counter()
    res = evaluate(pairs)
    took = time.perf_counter() - t0
    print(f"{'scenario':24} {'detector':14} {'fired':>6} {'false/early':>11} {'median delay':>13} {'max delay':>10}")
    for scen, row in res.items():
        for det, r in row.items():
            fe = r.get("false_alarms", r.get("early_alarms"))
            print(f"{scen:24} {det:14} {r['fired']:>6} {fe:>11} {str(r['median_delay']):>13} {str(r['max_delay']):>10}")
    fa = sum(res[f"{s}/none"]["rldiag"]["false_alarms"] for s in SETUPS)
    fa_3 = sum(res[f"{s}/none"]["threshold-3sd"]["false_alarms"] for s in SETUPS)
    fa_5 = sum(res[f"{s}/none"]["threshold-5sd"]["false_alarms"] for s in SETUPS)
    lvl = res["1 run/level"]
    summary = [
        summary_row("divergence: false alarms on seed replicates", f"{fa} of {2 * pairs} pairs",
                    f"fixed threshold: 3 sd {fa_3}, 5 sd {fa_5} of {2 * pairs}", "-", "0", fa == 0),
        summary_row("divergence: delay, 3-sd level shift (1 reference)",
                    f"median {lvl['rldiag']['median_delay']} steps ({lvl['rldiag']['detected']}/{pairs} found)",
                    f"5-sd threshold: {lvl['threshold-5sd']['detected']}/{pairs} found, median "
                    f"{lvl['threshold-5sd']['median_delay']}; 3 sd: {lvl['threshold-3sd']['early_alarms']}/{pairs} "
                    f"fired before the change",
                    "-", "median <= 5 steps",
                    lvl["rldiag"]["median_delay"] is not None and lvl["rldiag"]["median_delay"] <= 5
                    and lvl["rldiag"]["detected"] == pairs),
    ]
    write_result("divergence_quality", {"env": env_info(), "pairs": pairs, "quick": args.quick, "seconds": took,
                                        "scenarios": res, "summary": summary})
    print(f"\n{took:.1f} s; written bench/results/divergence_quality.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
