"""Divergence quality on labelled RL-like comparisons: false alarms, misses, time to alert (online) and
onset error, per change kind, vs a fixed threshold.

    python -m bench.divergence_quality            # 40 comparisons per change kind and 80 held out, ~2 minutes
    python -m bench.divergence_quality --quick    # 10 per kind
    python -m bench.divergence_quality --held-out 0   # without the 80 held-out seeds per kind
    python -m bench.divergence_quality --detector var_persist=12       # other detector options
    python -m bench.divergence_quality --held-out-from 120             # other held-out seeds
    python -m bench.divergence_quality --long-steps 100000 --held-out 0  # also 24 no-change runs of 100k steps
    python -m bench.divergence_quality --zeros   # exact zeros in half the positive metrics (first step, or 20-40%)
    python -m bench.divergence_quality --zeros often  # every metric positive and exactly 0 at 20-40% of steps

The set is `bench.divergence_rl` (AR(1) noise to phi 0.85, Student-t tails, spikes and bursts in every
run, seed wander and offsets, log-normal positive metrics; 1 to 4 reference seeds): candidates with
no change, extra spikes, still running; level shifts of 2, 3, 5 sd, drift, variance, NaN, inf stored
as max-float, a shift from step 0. Figures per kind:
- fired (no-change kinds: every one is a false alarm); early: the first alert came before the change;
- detected / missed; of the missed level shifts, how many the verdict owned up to: "within the band
  (a lasting shift under X would not show)" with X at least the shift (any other is a false all-clear);
- time to alert, measured online: the candidate is cut after each step from the change on and
  detection run on that prefix, as a watcher polling every step would; the delay is the last step of
  the first prefix that reports a departure, minus the change's first step;
- onset error: the onset the full run's detection reports, minus the true one ("onset err", from the
  change's first step); and per kind, the issue 43 figures (bench._onsets): median, worst early, how
  many > 10 steps early, how many before the first point out of the band; a drift (no sharp start) is
  also scored from where it alone reaches the band's edge, and left out of the pooled row.
The baseline is a dashboard threshold alert: the first step where the candidate is more than 3 (or 5)
sd from the references' mean, sd the references' point noise (first differences / sqrt 2).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from tqdm import tqdm

from bench import _onsets
from bench._common import env_info, summary_row, write_result
from bench.divergence_rl import CHANGES, MUST_DETECT, NO_CHANGE, Scenario, make_set, scenario
from rldiag.app.analysis.detector import finite_values
from rldiag.app.analysis.divergence import DivergenceConfig, detect_divergence
from rldiag.app.data.trace import Trace

HELD_OUT_FIRST = 40  # the defaults were chosen on seeds 0-39
HELD_OUT = 80  # held-out seeds per kind by default
SHIFTS_3SD = ("level3", "level5", "from0")  # the level shifts of 3 sd or more (goal: median time to alert <= 5)
LEVEL_SHIFTS = ("level2", *SHIFTS_3SD)  # a miss of these is honest only where the verdict says a shift that size would not show


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


def _shift(s: Scenario, zeros: bool | str) -> float:
    """A level shift's size in metric units: the median of |candidate - the same draw unchanged| after it."""
    base = scenario(s.seed, "none", zeros=zeros).candidate.values
    after = slice(s.onset or 0, None)
    with np.errstate(invalid="ignore"):
        return float(np.nanmedian(np.abs(s.candidate.values[after] - base[after])))


def threshold_alert(s: Scenario, k: float) -> int | None:
    ref = np.nanmean([finite_values(r.values) for r in s.references], axis=0)
    sd = np.nanstd(np.diff(finite_values(s.references[0].values))) / np.sqrt(2) * np.sqrt(1 + 1 / len(s.references))
    cand = s.candidate.values
    n = len(cand)
    with np.errstate(invalid="ignore"):
        bad = ~(np.abs(finite_values(cand) - ref[:n]) <= k * sd)
    hits = np.flatnonzero(bad)
    return int(s.candidate.steps[hits[0]]) if len(hits) else None


def evaluate(per_kind: int, config: DivergenceConfig | None = None, first_seed: int = 0, zeros: bool | str = False) -> dict:
    config = config or DivergenceConfig()
    rows: dict[str, dict] = {}
    for change in tqdm(CHANGES, desc="change kinds", unit="kind"):
        res = {"rldiag": [], "threshold-3sd": [], "threshold-5sd": []}
        said: list[bool] = []
        which: list[dict] = []  # no-change kinds: the draws that fired, and on what
        onsets: list[dict] = []  # changed kinds alerted at or after the change: bench._onsets.score
        for s in make_set(per_kind, (change,), first_seed, zeros):
            d = detect_divergence(list(s.references), s.candidate, config)
            if change in NO_CHANGE and d.diverged:
                f = d.first
                which.append({"seed": s.seed, "phi": s.phi, "dof": s.dof, "n_refs": s.n_refs, "kind": f.kind,
                              "onset_step": f.onset_step, "alert_step": f.alert_step, "end_step": f.end_step,
                              "sigma": round(float(f.delta_sigma), 2)})
            first_alert = d.alert_step
            if d.diverged and s.onset is not None and first_alert is not None and first_alert >= s.onset:
                first_alert = online_alert(s, config, first_alert)
            res["rldiag"].append((first_alert if d.diverged else None, d.onset_step, s))
            if d.diverged and s.onset is not None and d.alert_step is not None and d.alert_step >= s.onset:
                base = scenario(s.seed, "none", zeros=zeros).candidate.values if change == "drift" else None
                onsets.append(_onsets.score(list(s.references), s.candidate, s.onset, d, config, change, base))
            if change in LEVEL_SHIFTS and d.status == "within":  # a miss: did the verdict's size cover the shift?
                said.append(d.detectable >= _shift(s, zeros))
            for k, name in ((3.0, "threshold-3sd"), (5.0, "threshold-5sd")):
                a = threshold_alert(s, k)
                res[name].append((a, a, s))
        out = {}
        for det, found in res.items():
            fired = [(a, o, s) for a, o, s in found if a is not None]
            if change in NO_CHANGE:
                out[det] = {"n": len(found), "fired": len(fired), "false_alarms": len(fired),
                            **({"wrong_by_zeros": _by_zeros(found), "which": which} if det == "rldiag" else {})}
                continue
            early = [x for x in fired if x[0] < x[2].onset]
            hit = [x for x in fired if x[0] >= x[2].onset]
            delays = [a - s.onset for a, _, s in hit]
            onset_err = [o - s.onset for _, o, s in hit if o is not None]
            out[det] = {"n": len(found), "fired": len(fired), "early_alarms": len(early), "detected": len(hit),
                        "missed": len(found) - len(fired),
                        **({"time_to_alert_by_phi": _by_phi(found), "wrong_by_zeros": _by_zeros(found)}
                           if det == "rldiag" else {}),
                        "median_time_to_alert": float(np.median(delays)) if delays else None,
                        "p90_time_to_alert": float(np.percentile(delays, 90)) if delays else None,
                        "median_onset_error": float(np.median(onset_err)) if onset_err else None,
                        "delays": delays}
        if change not in NO_CHANGE:
            out["rldiag"]["onset"] = _onsets.summarise(onsets)
            out["rldiag"]["onset_errors"] = [o["error"] for o in onsets]
        if change in LEVEL_SHIFTS:
            out["rldiag"]["missed_said"] = sum(said)  # misses whose "a lasting shift under X" held X >= the shift
        rows[change] = out
    return rows


def _print(res: dict) -> None:
    print(f"{'change':10} {'detector':14} {'fired':>5} {'false/early':>11} {'missed':>6} {'alert median':>12} "
          f"{'p90':>5} {'onset err':>9}  onset err med / worst early / >10 early / before first out")
    for change, row in res.items():
        for det, r in row.items():
            fe = r.get("false_alarms", r.get("early_alarms"))
            print(f"{change:10} {det:14} {r['fired']:>5} {fe:>11} {r.get('missed', '-')!s:>6} "
                  f"{r.get('median_time_to_alert', '-')!s:>12} {r.get('p90_time_to_alert', '-')!s:>5} "
                  f"{r.get('median_onset_error', '-')!s:>9}  {_onsets.cell(r.get('onset'))}")


def _by_phi(found: list) -> dict:
    """Time to alert by the noise's AR(1) phi: median and range of the delays, and how many were missed
    or alerted before the change (how the noise's autocorrelation sets the delay)."""
    groups: dict[float, list] = {}
    for a, _, s in found:
        groups.setdefault(s.phi, []).append((a, s.onset))
    out = {}
    for phi in sorted(groups):
        delays = [a - o for a, o in groups[phi] if a is not None and a >= o]
        out[f"{phi:g}"] = {"median": float(np.median(delays)) if delays else None,
                           "range": [min(delays), max(delays)] if delays else [None, None],
                           "missed": sum(a is None for a, _ in groups[phi]),
                           "early": sum(a is not None and a < o for a, o in groups[phi]), "n": len(groups[phi])}
    return out


def _by_zeros(found: list) -> dict:
    """Per kind of exact zeros in the runs (bench.divergence_rl: none, first, often): comparisons and
    how many went wrong (fired on no change; missed or alerted early on a change)."""
    out: dict[str, list[int]] = {}
    for a, _, s in found:
        wrong = a is not None if s.onset is None else (a is None or a < s.onset)
        n_wrong = out.setdefault(s.zeros, [0, 0])
        n_wrong[0] += 1
        n_wrong[1] += int(wrong)
    return out


def _zeros_row(res: dict, label: str) -> dict:
    """Summary row: wrong verdicts on runs with zeros at 20-40% of their steps vs the others."""
    tot: dict[str, list[int]] = {}
    for change, row in res.items():
        if change not in NO_CHANGE + MUST_DETECT:
            continue
        for z, (n, w) in row["rldiag"]["wrong_by_zeros"].items():
            t = tot.setdefault("often" if z == "often" else "other", [0, 0])
            t[0] += n
            t[1] += w
    often, other = tot.get("often", [0, 0]), tot.get("other", [0, 0])
    return summary_row(f"divergence, {label}: wrong verdicts (false, early, missed on a required kind) on positive metrics "
                       "exactly 0 at 20-40% of steps", f"{often[1]} of {often[0]}", f"other runs: {other[1]} of {other[0]}",
                       "-", "0", often[1] == 0)


def _said_row(res: dict, label: str) -> dict:
    """Summary row: of the missed level shifts, how many the verdict owned up to ("within the band (a
    lasting shift under X would not show)" with X at least the shift's size); any other is a false all-clear."""
    parts, total, said = [], 0, 0
    for c in LEVEL_SHIFTS:
        r = res[c]["rldiag"]
        if r["missed"]:
            parts.append(f"{c} {r['missed_said']}/{r['missed']}")
            total, said = total + r["missed"], said + r["missed_said"]
    return summary_row(f"divergence, {label}: missed level shifts whose verdict says a shift that size would not show",
                       ", ".join(parts) or "no miss", "-", "-", "every miss", said == total)


def _onset_row(res: dict, label: str) -> dict:
    """Summary row: onset error pooled over the changed kinds but drift (no sharp start: bench._onsets), its
    worst early, how many > 10 steps early and how many before the first point out of the band."""
    errors = [e for c, r in res.items() if c != "drift" for e in r["rldiag"].get("onset_errors", [])]
    before = sum(r["rldiag"]["onset"]["before_first_out"] for c, r in res.items()
                 if c != "drift" and "onset" in r["rldiag"])
    med = float(np.median(errors)) if errors else None
    early = sum(e < -10 for e in errors)
    return summary_row(f"divergence, {label}: onset error (onset - change step), changed kinds but drift",
                       f"median {med}, worst {min(errors, default=None)}, "
                       f"{early} > 10 steps early, {before} before the first point out, of {len(errors)}", "-", "-",
                       "median <= 2, none > 10 early or before the first point out",
                       med is not None and med <= 2 and early == 0 and before == 0)


def _print_fired(res: dict) -> None:
    """The no-change draws that fired (one draw is shared by the no-change kinds: counted once per kind)."""
    for change in NO_CHANGE:
        for w in res[change]["rldiag"]["which"]:
            end = "the end" if w["end_step"] is None else f"step {w['end_step']}"
            print(f"false alarm: {change} seed {w['seed']} (phi {w['phi']}, t dof {w['dof']}, {w['n_refs']} refs): "
                  f"{w['kind']} from step {w['onset_step']} to {end}, alerted at {w['alert_step']}, {w['sigma']:+} sd")


def _print_by_phi(res: dict, change: str = "level3") -> None:
    """Time to alert of one change kind by the noise's AR(1) phi (rldiag): median, range, missed / n."""
    by = res.get(change, {}).get("rldiag", {}).get("time_to_alert_by_phi", {})
    print(f"{change} by noise phi (rldiag): " + "; ".join(
        f"phi {k}: median {v['median']} ({v['range'][0]}-{v['range'][1]}), missed {v['missed']}/{v['n']}"
        + (f", early {v['early']}" if v["early"] else "")
        for k, v in by.items()))


def _totals(res: dict, det: str = "rldiag") -> tuple[int, int, dict, float | None]:
    """(false alarms on no-change kinds, alerts before a change, misses per required kind, pooled median
    time to alert over the shifts of 3 sd or more)."""
    mine = {c: r[det] for c, r in res.items()}
    false = sum(mine[c]["false_alarms"] for c in NO_CHANGE)
    early = sum(mine[c]["early_alarms"] for c in CHANGES if c not in NO_CHANGE)
    pooled = [x for c in SHIFTS_3SD for x in mine[c]["delays"]]
    return false, early, {c: mine[c]["missed"] for c in MUST_DETECT}, float(np.median(pooled)) if pooled else None


def _long_run(steps: int, n: int, config: DivergenceConfig, zeros: bool | str = False) -> dict:
    """`n` no-change comparisons of bench.divergence_rl (seeds 0..n-1) with runs `steps` long."""
    import bench.divergence_rl as rl

    saved, rl.T = rl.T, steps
    try:
        flagged = []
        for seed in tqdm(range(n), desc=f"{steps}-step runs", unit="run"):
            s = rl.scenario(seed, "none", zeros=zeros)
            d = detect_divergence(list(s.references), s.candidate, config)
            if d.diverged:
                flagged.append({"seed": seed, "phi": s.phi, "dof": s.dof, "n_refs": s.n_refs,
                                "kind": d.kind, "onset_step": d.onset_step})
    finally:
        rl.T = saved
    print(f"\n{n} no-change candidates of {steps} steps: {len(flagged)} flagged "
          + ", ".join(f"seed {f['seed']} ({f['n_refs']} refs, phi {f['phi']}, {f['kind']} at {f['onset_step']})"
                      for f in flagged))
    return {"steps": steps, "n": n, "flagged": len(flagged), "which": flagged}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-kind", type=int, default=40, help="comparisons per change kind (default: 40)")
    ap.add_argument("--quick", action="store_true", help="10 comparisons per change kind (and 10 held out)")
    ap.add_argument("--held-out", type=int, default=None, metavar="N",
                    help=f"also N per kind on seeds from {HELD_OUT_FIRST} on, which the defaults were not chosen on "
                         "(default 80; --quick 10; 0: none)")
    ap.add_argument("--held-out-from", type=int, default=HELD_OUT_FIRST, metavar="SEED",
                    help=f"first held-out seed (default {HELD_OUT_FIRST})")
    ap.add_argument("--long-steps", type=int, default=0, metavar="T",
                    help="also score --long-n no-change candidates (seeds 0..) whose runs are T steps long "
                         "(a long run is tested at more positions); results go to divergence_quality_long.json (with --zeros or --detector: _options.json)")
    ap.add_argument("--long-n", type=int, default=24, metavar="N", help="no-change candidates at --long-steps")
    ap.add_argument("--detector", action="append", default=[], metavar="KEY=VALUE",
                    help="a DivergenceConfig option (repeatable), e.g. var_persist=12; results of a run "
                         "with options or --held-out-from go to divergence_quality_options.json")
    ap.add_argument("--zeros", nargs="?", const="mixed", choices=("mixed", "often"), default=None,
                    help="exact zeros in half the positive metrics: at every run's first step, or at 20-40%% of its "
                         "steps (results go to divergence_quality_zeros.json); 'often': every metric positive and "
                         "exactly 0 at 20-40%% of its steps (divergence_quality_zeros_often.json)")
    args = ap.parse_args(argv)
    per_kind = 10 if args.quick else args.per_kind
    held = args.held_out if args.held_out is not None else (10 if args.quick else HELD_OUT)
    config = DivergenceConfig.from_options(args.detector)
    zeros = {None: False, "mixed": True, "often": "often"}[args.zeros]
    t0 = time.perf_counter()
    res = evaluate(per_kind, config, zeros=zeros)
    if per_kind:  # --per-kind 0: the held-out seeds alone
        _print(res)
        _print_fired(res)
        _print_by_phi(res)
    held_res = {}
    if held:
        first = max(args.held_out_from, per_kind)
        print(f"\nheld-out seeds {first}-{first + held - 1}:")
        held_res = evaluate(held, config, first, zeros)
        _print(held_res)
        _print_fired(held_res)
        _print_by_phi(held_res)
    long_run = _long_run(args.long_steps, args.long_n, config, zeros) if args.long_steps else None
    took = time.perf_counter() - t0
    summary = []
    if per_kind:  # the seeds 0-39 rows
        false, early, missed, med = _totals(res)
        base_false, base_early, _, _ = _totals(res, "threshold-5sd")
        base_delays = [x for c in SHIFTS_3SD for x in res[c]["threshold-5sd"]["delays"]]
        n_null = per_kind * len(CHANGES)
        summary += [
            summary_row("divergence (RL-like set): false alarms", f"{false + early} of {n_null} comparisons",
                        f"5-sd threshold alert: {base_false + base_early}", "-", "0", false + early == 0),
            summary_row("divergence: misses on shifts >= 3 sd, drift, variance, NaN, inf",
                        ", ".join(f"{c} {v}/{per_kind}" for c, v in missed.items()), "-", "-", "0",
                        sum(missed.values()) == 0),
            summary_row("divergence: time to alert (online), level shifts >= 3 sd", f"median {med} steps",
                        f"5-sd threshold: median {np.median(base_delays)} with {base_false + base_early} false alarms",
                        "-", "median <= 5 steps", med is not None and med <= 5),
        ]
        summary.append(_said_row(res, f"seeds 0-{per_kind - 1}"))
        summary.append(_onset_row(res, f"seeds 0-{per_kind - 1}"))
        if zeros is True:
            summary.append(_zeros_row(res, f"seeds 0-{per_kind - 1}"))
    if held:
        h_false, h_early, h_missed, h_med = _totals(held_res)
        summary.append(summary_row(
            f"divergence, {held} held-out seeds per kind from seed {args.held_out_from} (defaults chosen on seeds 0-39, "
            "var_persist also on 40-119: README): false / early alarms, "
            "misses, time to alert", f"{h_false} false of {held * len(NO_CHANGE)}, {h_early} early of "
            f"{held * (len(CHANGES) - len(NO_CHANGE))}; misses " + ", ".join(f"{c} {v}" for c, v in h_missed.items() if v)
            + f"; median {h_med} steps", "-", "-", "0 false, 0 early", h_false + h_early == 0))
        summary.append(_said_row(held_res, f"held-out seeds from {args.held_out_from}"))
        summary.append(_onset_row(held_res, f"held-out seeds from {args.held_out_from}"))
        if zeros is True:
            summary.append(_zeros_row(held_res, f"held-out seeds from {args.held_out_from}"))
    if zeros:  # its rows beside the default run's in README's table
        which = ("zeros in half the positive metrics" if zeros is True
                 else "every metric positive and exactly 0 at 20-40% of steps")
        for row in summary:
            if "exactly 0" not in row["benchmark"] or zeros == "often":
                row["benchmark"] = row["benchmark"].replace("divergence", f"divergence, {which}", 1)
    for r in (r for x in (res, held_res) for row in x.values() for r in row.values()):
        r.pop("delays", None)
    if long_run is not None:
        if not args.detector and held == 0:  # a run for the long figure only: its one row in the README table
            summary.clear()
        summary.append(summary_row(
            f"divergence, {args.long_n} no-change candidates of {args.long_steps} steps: flagged",
            f"{long_run['flagged']} of {args.long_n}", "-", "-", "0", long_run["flagged"] == 0))
    # README's figures: the default run, the long one, the two zeros ones; any other run: _options
    # (the long one's seeds and steps are its own; the others are README's only at the default sizes)
    plain = not args.detector and args.held_out_from == HELD_OUT_FIRST and not args.quick
    sized = plain and per_kind == ap.get_default("per_kind") and held == HELD_OUT
    if long_run is not None:
        name = "divergence_quality_long" if plain and not zeros else "divergence_quality_options"
    elif zeros:
        name = ("divergence_quality_zeros_often" if zeros == "often" else "divergence_quality_zeros") if sized \
            else "divergence_quality_options"
    else:
        name = "divergence_quality" if sized else "divergence_quality_options"
    write_result(name, {"env": env_info(), "per_kind": per_kind, "held_out_per_kind": held, "quick": args.quick,
                        "seconds": took, "config": repr(config), "scenarios": res, "held_out": held_res,
                        "long_run": long_run, "summary": summary})
    print(f"\n{took:.1f} s; written bench/results/{name}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
