"""Divergence quality on labelled RL-like comparisons: false alarms, misses, time to alert (online) and
onset error, per change kind, vs a fixed threshold.

    python -m bench.divergence_quality            # 40 comparisons per change kind, about 3 minutes
    python -m bench.divergence_quality --quick    # 10 per kind

The set is `bench.divergence_rl` (AR(1) noise to phi 0.85, Student-t tails, spikes and bursts in every
run, seed wander and offsets, log-normal positive metrics; 1 to 4 reference seeds): candidates with
no change, extra spikes, still running; level shifts of 2, 3, 5 sd, drift, variance, NaN, inf stored
as max-float, a shift from step 0. Figures per kind:
- fired (no-change kinds: every one is a false alarm); early: the first alert came before the change;
- detected / missed;
- time to alert, measured online: the candidate is cut after each step from the change on and
  detection run on that prefix, as a watcher polling every step would; the delay is the last step of
  the first prefix that reports a departure, minus the change's first step;
- onset error: the onset the full run's detection reports, minus the true one.
The baseline is a dashboard threshold alert: the first step where the candidate is more than 3 (or 5)
sd from the references' mean, sd the references' point noise (first differences / sqrt 2).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from tqdm import tqdm

from bench._common import env_info, summary_row, write_result
from bench.divergence_rl import CHANGES, MUST_DETECT, NO_CHANGE, Scenario, make_set
from rldiag.app.analysis.detector import finite_values
from rldiag.app.analysis.divergence import DivergenceConfig, detect_divergence
from rldiag.app.data.trace import Trace

SHIFTS_3SD = ("level3", "level5", "from0")  # the level shifts of 3 sd or more (goal: median time to alert <= 5)


def _prefix(t: Trace, n: int) -> Trace:
    return Trace(t.run_id, t.key, t.source_key, t.steps[:n], t.values[:n], t.timestamps[:n])


def online_alert(s: Scenario, config: DivergenceConfig, full_alert: int | None) -> int | None:
    """The last step of the first prefix (from the change on) whose detection reports a departure."""
    start = s.onset or 0
    stop = len(s.candidate) if full_alert is None else min(len(s.candidate), full_alert + 1)
    for n in range(start + 1, stop + 1):
        if detect_divergence(list(s.references), _prefix(s.candidate, n), config).diverged:
            return int(s.candidate.steps[n - 1])
    return None


def threshold_alert(s: Scenario, k: float) -> int | None:
    ref = np.nanmean([finite_values(r.values) for r in s.references], axis=0)
    sd = np.nanstd(np.diff(finite_values(s.references[0].values))) / np.sqrt(2) * np.sqrt(1 + 1 / len(s.references))
    cand = s.candidate.values
    n = len(cand)
    with np.errstate(invalid="ignore"):
        bad = ~(np.abs(finite_values(cand) - ref[:n]) <= k * sd)
    hits = np.flatnonzero(bad)
    return int(s.candidate.steps[hits[0]]) if len(hits) else None


def evaluate(per_kind: int, config: DivergenceConfig | None = None) -> dict:
    config = config or DivergenceConfig()
    rows: dict[str, dict] = {}
    for change in tqdm(CHANGES, desc="change kinds", unit="kind"):
        res = {"rldiag": [], "threshold-3sd": [], "threshold-5sd": []}
        for s in make_set(per_kind, (change,)):
            d = detect_divergence(list(s.references), s.candidate, config)
            first_alert = d.alert_step
            if d.diverged and s.onset is not None and first_alert is not None and first_alert >= s.onset:
                first_alert = online_alert(s, config, first_alert)
            res["rldiag"].append((first_alert if d.diverged else None, d.onset_step, s))
            for k, name in ((3.0, "threshold-3sd"), (5.0, "threshold-5sd")):
                a = threshold_alert(s, k)
                res[name].append((a, a, s))
        out = {}
        for det, found in res.items():
            fired = [(a, o, s) for a, o, s in found if a is not None]
            if change in NO_CHANGE:
                out[det] = {"n": len(found), "fired": len(fired), "false_alarms": len(fired)}
                continue
            early = [x for x in fired if x[0] < x[2].onset]
            hit = [x for x in fired if x[0] >= x[2].onset]
            delays = [a - s.onset for a, _, s in hit]
            onset_err = [o - s.onset for _, o, s in hit if o is not None]
            out[det] = {"n": len(found), "fired": len(fired), "early_alarms": len(early), "detected": len(hit),
                        "missed": len(found) - len(fired),
                        "median_time_to_alert": float(np.median(delays)) if delays else None,
                        "p90_time_to_alert": float(np.percentile(delays, 90)) if delays else None,
                        "median_onset_error": float(np.median(onset_err)) if onset_err else None,
                        "delays": delays}
        rows[change] = out
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-kind", type=int, default=40, help="comparisons per change kind (default: 40)")
    ap.add_argument("--quick", action="store_true", help="10 comparisons per change kind")
    args = ap.parse_args(argv)
    per_kind = 10 if args.quick else args.per_kind
    t0 = time.perf_counter()
    res = evaluate(per_kind)
    took = time.perf_counter() - t0
    print(f"{'change':10} {'detector':14} {'fired':>5} {'false/early':>11} {'missed':>6} {'alert median':>12} "
          f"{'p90':>5} {'onset err':>9}")
    for change, row in res.items():
        for det, r in row.items():
            fe = r.get("false_alarms", r.get("early_alarms"))
            print(f"{change:10} {det:14} {r['fired']:>5} {fe:>11} {r.get('missed', '-')!s:>6} "
                  f"{r.get('median_time_to_alert', '-')!s:>12} {r.get('p90_time_to_alert', '-')!s:>5} "
                  f"{r.get('median_onset_error', '-')!s:>9}")
    mine = {c: r["rldiag"] for c, r in res.items()}
    false = sum(mine[c]["false_alarms"] for c in NO_CHANGE) + sum(mine[c]["early_alarms"] for c in CHANGES
                                                                   if c not in NO_CHANGE)
    missed = {c: mine[c]["missed"] for c in MUST_DETECT}
    pooled = [x for c in SHIFTS_3SD for x in mine[c]["delays"]]
    med = float(np.median(pooled)) if pooled else None
    base = {c: r["threshold-5sd"] for c, r in res.items()}
    base_false = sum(base[c]["false_alarms"] for c in NO_CHANGE) + sum(base[c]["early_alarms"] for c in CHANGES
                                                                        if c not in NO_CHANGE)
    n_null = per_kind * len(CHANGES)
    summary = [
        summary_row("divergence (RL-like set): false alarms", f"{false} of {n_null} comparisons",
                    f"5-sd threshold alert: {base_false}", "-", "0", false == 0),
        summary_row("divergence: misses on shifts >= 3 sd, drift, variance, NaN, inf",
                    ", ".join(f"{c} {v}/{per_kind}" for c, v in missed.items()), "-", "-", "0",
                    sum(missed.values()) == 0),
        summary_row("divergence: time to alert (online), level shifts >= 3 sd", f"median {med} steps",
                    f"5-sd threshold: median {np.median([x for c in SHIFTS_3SD for x in base[c]['delays']])}"
                    f" with {base_false} false alarms", "-", "median <= 5 steps", med is not None and med <= 5),
    ]
    for row in res.values():
        for r in row.values():
            r.pop("delays", None)
    write_result("divergence_quality", {"env": env_info(), "per_kind": per_kind, "quick": args.quick, "seconds": took,
                                        "config": repr(DivergenceConfig()), "scenarios": res, "summary": summary})
    print(f"\n{took:.1f} s; written bench/results/divergence_quality.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
