"""Divergence quality by run length (issue 43): false alarms, early alerts, misses, time to alert and
onset error on labelled RL-like comparisons of 1k, 10k and 100k steps, with the noise that made
false alarms on long runs.

    python -m bench.divergence_length --quick        # tuning seeds, few per cell: <= 2 minutes on 2 cores
    python -m bench.divergence_length                 # tuning seeds, the full counts (~10 minutes)
    python -m bench.divergence_length --held-out      # the frozen held-out split (report it once per change)
    python -m bench.divergence_length --detector impulse_clip=10   # other detector options
    python -m bench.divergence_length --refs 1 --lengths 10000,100000 --kinds none,wander   # a slice (tuning seeds)

Each comparison is one metric: 1 to 4 reference seeds and a candidate of one configuration. Every run
carries a trend over the run's length (tau 10-60% of it), AR(1) noise of marginal sd 1 (phi 0 to 0.85,
Student-t innovations of 3 to 30 dof or Gaussian), isolated spikes (1 in 200 steps, 4-30 sd), a short
burst or two, heavy-tailed jumps (one AR(1) innovation of 11-15 sd, decaying as phi^k, about one per
5000 steps), a per-seed level offset and slow wander (AR(1), rho 0.995, up to 0.35 sd); 40% of metrics
are positive (exp of such a curve, sizes in sd of the log). Kinds:
- no change: `none`; `jump` (the candidate holds one more 11-15 sd jump); `warmup` (a 3-step burst of
  4-8 sd within its first 6 steps, as a gradient norm has; each reference has one with probability
  1/2); `wander` (every seed wanders more and slower: 0.35-0.5 sd, rho 0.999);
- changes from a step drawn in the middle half of the run: `level3`, `level5` (sd of the noise,
  either sign), `drift` (0.03 sd per step), `variance` (noise sd 1 -> sqrt 10), `nan`.
Figures per run length and kind: false alarms (no-change kinds: any departure, per candidate x metric);
early (a changed candidate's first alert before the change); misses; median time to alert measured
online (the candidate cut after each step from the change on, as a watcher polling every step sees it;
more than 64 prefixes apart: bisection, as the scan is causal); onset error (the full run's first
departure's onset minus the change's step; median, how many are more than 10 steps early, the worst
early and how many before the first point out of the band: bench._onsets; a drift, which has no sharp
start, is also scored from where it alone reaches the band's edge, and left out of the pooled figures).

Seeds: tuning on 0, 1, 2, ... (per run length), or from `--seeds-from N` (a fresh range to explore where the
tuning seeds, on which every rule was chosen, no longer show what is wrong); the held-out split is HELD_OUT_SEEDS,
frozen: no detector option may be chosen on it, and it is scored once per detector change (`--held-out`).
SPENT_HELD_OUT (9100000-9100099) was the held-out split until 2026-12-07: scored after each of six changes, with
the seeds it flagged named in bench/README.md (now in its git history) and read in notes, so it no longer tells
what unseen runs would get.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from scipy.signal import lfilter

from bench import _onsets
from bench._common import env_info, summary_row, write_result
from rldiag.app.analysis.divergence import DivergenceConfig, detect_divergence
from rldiag.app.data.trace import Trace

LENGTHS = (1_000, 10_000, 100_000)
NO_CHANGE = ("none", "jump", "warmup", "wander")
CHANGED = ("level3", "level5", "drift", "variance", "nan")
KINDS = NO_CHANGE + CHANGED
HELD_OUT_SEEDS = range(9_300_000, 9_300_100)  # frozen: never tune on these (scored with --held-out only)
SPENT_HELD_OUT = range(9_100_000, 9_100_100)  # the held-out split before 2026-12-07 (sixth session): seen, not unseen
PER_CELL = {1_000: 60, 10_000: 24, 100_000: 8}  # comparisons per kind and run length (full run)
PER_CELL_QUICK = {1_000: 16, 10_000: 6, 100_000: 2}
JUMP_RATE = 1 / 5000  # background heavy-tailed jumps per step


def _noise(rng: np.random.Generator, n: int, phi: float, dof: float, jumps: list[tuple[int, float]]) -> np.ndarray:
    """AR(1) noise of marginal sd 1 (t or Gaussian innovations) with the given (step, size) jumps as
    innovations (in marginal sd), each decaying as phi^k."""
    e = rng.standard_normal(n) if not np.isfinite(dof) else rng.standard_t(dof, n) / np.sqrt(dof / (dof - 2))
    e *= np.sqrt(1 - phi**2)
    for at, size in jumps:
        e[at] += size
    e[0] = rng.standard_normal() + sum(s for a, s in jumps if a == 0)
    return lfilter([1.0], [1.0, -phi], e)


def _wander(rng: np.random.Generator, n: int, sd: float, rho: float) -> np.ndarray:
    kicks = rng.normal(0, sd * np.sqrt(1 - rho**2), n)
    kicks[0] = rng.normal(0, sd)
    return lfilter([1.0], [1.0, -rho], kicks)


def _jumps(rng: np.random.Generator, n: int, extra: int = 0) -> list[tuple[int, float]]:
    k = rng.poisson(JUMP_RATE * n) + extra
    return [(int(rng.integers(0, n)), float(rng.choice([-1, 1]) * rng.uniform(11, 15))) for _ in range(k)]


def _outliers(rng: np.random.Generator, n: int) -> np.ndarray:
    out = np.zeros(n)
    hit = np.flatnonzero(rng.random(n) < 1 / 200)
    out[hit] = rng.choice([-1, 1], len(hit)) * rng.uniform(4, 30, len(hit))
    for _ in range(rng.poisson(max(1.0, n / 1000))):
        start, length = int(rng.integers(0, n)), int(rng.integers(2, 5))
        out[start:start + length] += rng.choice([-1, 1]) * rng.uniform(3, 8)
    return out


def _warmup(rng: np.random.Generator, n: int) -> np.ndarray:
    out = np.zeros(n)
    start = int(rng.integers(0, 4))
    out[start:start + 3] = rng.uniform(4, 8)
    return out


def _trace(values: np.ndarray, run: str) -> Trace:
    return Trace(run, "m", "m", np.arange(len(values), dtype=np.int64), np.asarray(values, float),
                 np.zeros(len(values), np.int64))


def scenario(seed: int, kind: str, n: int, refs: int | None = None) -> tuple[list[Trace], Trace, int | None, dict]:
    """(references, candidate, first changed step or None, the draw's parameters) for comparison `seed`
    of run length `n`; one seed's configuration and candidate noise are the same for every kind. `refs`:
    that many references instead of the drawn count (set after the draw, so every other draw stays)."""
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r}: use one of {', '.join(KINDS)}")
    rng = np.random.default_rng([seed, n])
    phi = float(rng.choice([0.0, 0.3, 0.6, 0.75, 0.85]))
    dof = float(rng.choice([3.0, 5.0, 30.0, np.inf]))
    positive = bool(rng.random() < 0.4)
    n_refs = int(rng.choice([1, 2, 3, 4]))
    n_refs = n_refs if refs is None else refs
    wander_sd, offset_sd, rho = rng.uniform(0, 0.35), rng.uniform(0, 0.35), 0.995
    if kind == "wander":
        wander_sd, rho = rng.uniform(0.35, 0.5), 0.999
    t = np.arange(n)
    base = rng.uniform(-4, 4) * (1 - np.exp(-t / (rng.uniform(0.1, 0.6) * n)))
    log_scale, level = rng.uniform(0.15, 0.6), rng.uniform(-4, 1)
    onset = int(rng.integers(n // 4, 3 * n // 4))

    def run(r: np.random.Generator, extra_jumps: int = 0, warm: bool = False) -> np.ndarray:
        x = base + _wander(r, n, wander_sd, rho) + r.normal(0, offset_sd)
        x = x + _noise(r, n, phi, dof, _jumps(r, n, extra_jumps)) + _outliers(r, n)
        return x + _warmup(r, n) if warm else x

    refs = []
    for j in range(n_refs):
        r = np.random.default_rng([seed, n, j])
        refs.append(run(r, warm=kind == "warmup" and r.random() < 0.5))
    cr = np.random.default_rng([seed, n, 99])
    cand = run(cr, extra_jumps=int(kind == "jump"), warm=kind == "warmup")
    sign = float(cr.choice([-1, 1]))
    at: int | None = onset
    if kind in NO_CHANGE:
        at = None
    elif kind.startswith("level"):
        cand[onset:] += sign * float(kind[5:])
    elif kind == "drift":
        cand[onset:] += sign * 0.03 * np.arange(n - onset)
    elif kind == "variance":
        cand[onset:] += cr.normal(0, 3.0, n - onset)

    def finish(x: np.ndarray) -> np.ndarray:
        return np.exp(level + log_scale * x) if positive else 10 + x

    cand_v = finish(cand)
    if kind == "nan":
        cand_v[onset:] = np.nan
    info = {"seed": seed, "phi": phi, "dof": dof, "positive": positive, "n_refs": n_refs}
    return [_trace(finish(x), f"ref{j}") for j, x in enumerate(refs)], _trace(cand_v, "cand"), at, info


def _prefix(t: Trace, k: int) -> Trace:
    return Trace(t.run_id, t.key, t.source_key, t.steps[:k], t.values[:k], t.timestamps[:k])


def online_alert(refs: list[Trace], cand: Trace, start: int, full_alert: int, config) -> int | None:
    """The last step of the first prefix (from `start` on) whose detection reports a departure: every
    prefix where they are at most 64, else a bisection (the scan is causal, so a prefix diverges from
    the first step that does on)."""
    def fires(k: int) -> bool:
        return detect_divergence(refs, _prefix(cand, k), config).diverged

    lo, hi = start + 1, min(len(cand.steps), full_alert + 1)
    if hi < lo:
        return None
    if hi - lo <= 64:
        return next((int(cand.steps[k - 1]) for k in range(lo, hi + 1) if fires(k)), None)
    if not fires(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fires(mid) else (mid + 1, hi)
    return int(cand.steps[lo - 1])


def evaluate(lengths: dict[int, int], config: DivergenceConfig, seeds_from: int | range = 0,
             kinds: tuple[str, ...] = KINDS, n_refs: int | None = None) -> dict:
    """Per run length and kind: counts and figures (see the module docstring); `n_refs`: see `scenario`."""
    out: dict[str, dict] = {}
    for n, count in lengths.items():
        seeds = list(seeds_from)[:count] if isinstance(seeds_from, range) else range(seeds_from, seeds_from + count)
        row: dict[str, dict] = {}
        for kind in kinds:
            fired, early, missed, delays, onsets, which = 0, 0, 0, [], [], []
            for seed in seeds:
                refs, cand, at, info = scenario(seed, kind, n, n_refs)
                d = detect_divergence(refs, cand, config)
                if not d.diverged:
                    missed += at is not None
                    continue
                fired += 1
                if at is None or d.alert_step < at:
                    early += at is not None
                    which.append({**info, "kind": d.kind, "onset": d.onset_step, "alert": d.alert_step,
                                  "end": d.end_step, "sd": round(float(d.first.delta_sigma), 2)})
                    continue
                a = online_alert(refs, cand, at, d.alert_step, config)
                delays.append(None if a is None else a - at)
                base = scenario(seed, "none", n, n_refs)[1].values if kind == "drift" else None
                onsets.append(_onsets.score(refs, cand, at, d, config, kind, base))
            got = [x for x in delays if x is not None]
            errors = [o["error"] for o in onsets]
            r = {"n": len(seeds), "fired": fired}
            if kind in NO_CHANGE:
                r["false_alarms"] = fired
            else:
                r |= {"early": early, "missed": missed,
                      "median_time_to_alert": float(np.median(got)) if got else None,
                      "median_onset_error": float(np.median(errors)) if errors else None,
                      "onset_over_10_early": sum(e < -10 for e in errors), "onset": _onsets.summarise(onsets),
                      "onset_errors": errors, "delays": got}
            r["which"] = which
            row[kind] = r
        out[str(n)] = row
    return out


def _print(res: dict) -> None:
    print(f"{'length':>7} {'kind':9} {'n':>3} {'false/early':>11} {'missed':>6} {'alert med':>9} "
          f"{'onset err med':>13} {'onset >10 early':>15}  onset med / worst early / >10 early / before first out")
    for n, row in res.items():
        for kind, r in row.items():
            fe = r.get("false_alarms", r.get("early"))
            print(f"{n:>7} {kind:9} {r['n']:>3} {fe:>11} {r.get('missed', '-')!s:>6} "
                  f"{r.get('median_time_to_alert', '-')!s:>9} {r.get('median_onset_error', '-')!s:>13} "
                  f"{r.get('onset_over_10_early', '-')!s:>15}  {_onsets.cell(r.get('onset'))}")
        for kind, r in row.items():
            for w in r["which"]:
                what = "false alarm" if kind in NO_CHANGE else "early alert"
                print(f"  {what}: {n} steps, {kind} seed {w['seed']} (phi {w['phi']}, dof {w['dof']}, "
                      f"{w['n_refs']} refs): {w['kind']} from {w['onset']} alerted at {w['alert']}, {w['sd']:+} sd")


def totals(res: dict) -> dict:
    """Pooled over run lengths: false alarms, early alerts, misses, median time to alert and onset error."""
    rows = [(k, r) for row in res.values() for k, r in row.items()]
    delays = [x for k, r in rows if k in ("level3", "level5") for x in r["delays"]]
    errors = [x for k, r in rows if k != "drift" for x in r.get("onset_errors", [])]
    return {"false": sum(r.get("false_alarms", 0) for _, r in rows),
            "no_change": sum(r["n"] for k, r in rows if k in NO_CHANGE),
            "early": sum(r.get("early", 0) for _, r in rows), "missed": sum(r.get("missed", 0) for _, r in rows),
            "changed": sum(r["n"] for k, r in rows if k in CHANGED),
            "median_time_to_alert_3sd_up": float(np.median(delays)) if delays else None,
            "median_onset_error_no_drift": float(np.median(errors)) if errors else None,
            "onset_over_10_early": sum(e < -10 for e in errors),  # drift left out: bench._onsets
            "worst_onset_early": min(errors, default=None),
            "onsets_before_first_out": sum(r["onset"]["before_first_out"] for k, r in rows
                                           if k != "drift" and "onset" in r),
            "onsets_scored": len(errors)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"per kind: {PER_CELL_QUICK} (<= 2 minutes)")
    ap.add_argument("--held-out", action="store_true",
                    help=f"the frozen held-out seeds {HELD_OUT_SEEDS.start}-{HELD_OUT_SEEDS.stop - 1} "
                         "(never tune on them)")
    ap.add_argument("--detector", action="append", default=[], metavar="KEY=VALUE",
                    help="a DivergenceConfig option (repeatable); results go to divergence_length_options.json")
    ap.add_argument("--refs", type=int, choices=(1, 2, 3, 4), help="this many references in every comparison "
                    "(set after the draw: all else as drawn); results go to divergence_length_slice.json")
    ap.add_argument("--lengths", help=f"comma-separated run lengths of {LENGTHS} (default all); a slice")
    ap.add_argument("--kinds", help=f"comma-separated kinds of {', '.join(KINDS)} (default all); a slice")
    ap.add_argument("--seeds-from", type=int, metavar="N", help="draw the comparisons from seed N on instead of 0 "
                    "(a fresh range to explore; not the held-out seeds); a slice")
    ap.add_argument("--count", type=int, help="comparisons per kind and run length (default: the full or quick "
                    "counts); a slice")
    args = ap.parse_args(argv)
    config = DivergenceConfig.from_options(args.detector)
    lengths = dict(PER_CELL_QUICK if args.quick else PER_CELL)
    if args.lengths:
        if bad := [x for x in args.lengths.split(",") if not (x.isdigit() and int(x) in LENGTHS)]:
            ap.error(f"--lengths {args.lengths}: {bad[0]!r} is no run length of the bench; use some of "
                     f"{','.join(map(str, LENGTHS))}")
        lengths = {int(x): lengths[int(x)] for x in args.lengths.split(",")}
    kinds = tuple(args.kinds.split(",")) if args.kinds else KINDS
    if bad := [k for k in kinds if k not in KINDS]:
        ap.error(f"--kinds {args.kinds}: {bad[0]!r} is no kind of the bench; use some of {','.join(KINDS)}")
    if args.count is not None:
        if args.count < 1:
            ap.error(f"--count {args.count}: use 1 or more comparisons per kind and run length")
        lengths = {n: args.count for n in lengths}
    if args.seeds_from is not None:
        end = args.seeds_from + max(lengths.values())
        if args.seeds_from < 0 or (args.seeds_from < HELD_OUT_SEEDS.stop and end > HELD_OUT_SEEDS.start):
            ap.error(f"--seeds-from {args.seeds_from}: seeds {args.seeds_from}-{end - 1} are negative or reach "
                     f"the held-out seeds {HELD_OUT_SEEDS.start}-{HELD_OUT_SEEDS.stop - 1}; start outside them")
    sliced = bool(args.refs or args.lengths or args.kinds or args.count is not None or args.seeds_from is not None)
    if sliced and args.held_out:
        ap.error("--held-out scores the whole frozen split once: drop --refs/--lengths/--kinds/--count/--seeds-from")
    t0 = time.perf_counter()
    res = evaluate(lengths, config, HELD_OUT_SEEDS if args.held_out else args.seeds_from or 0, kinds, args.refs)
    took = time.perf_counter() - t0
    _print(res)
    tot = totals(res)
    split = ("held-out seeds" if args.held_out else f"seeds from {args.seeds_from}" if args.seeds_from is not None
             else "tuning seeds")
    print(f"\n{split}: {tot}\n{took:.1f} s")
    for row in res.values():
        for r in row.values():
            r.pop("delays", None)
    summary = [summary_row(
        f"divergence by run length (1k/10k/100k steps, {split}{', quick' if args.quick else ''}): false alarms, "
        "early alerts, misses", f"{tot['false']} false of {tot['no_change']}, {tot['early']} early and "
        f"{tot['missed']} missed of {tot['changed']}", "-", "-", "0 false, 0 early, 0 missed",
        tot["false"] + tot["early"] + tot["missed"] == 0),
        summary_row(f"divergence by run length ({split}{', quick' if args.quick else ''}): onset error (onset - "
                    "change step), changed kinds but drift",
                    f"median {tot['median_onset_error_no_drift']}, worst {tot['worst_onset_early']}, "
                    f"{tot['onset_over_10_early']} > 10 steps early, {tot['onsets_before_first_out']} before the first "
                    f"point out, of {tot['onsets_scored']}", "-", "-",
                    "median <= 2, none > 10 early or before the first point out",
                    tot["median_onset_error_no_drift"] is not None and tot["median_onset_error_no_drift"] <= 2
                    and tot["onset_over_10_early"] + tot["onsets_before_first_out"] == 0)]
    name = ("divergence_length_slice" if sliced else "divergence_length_options" if args.detector else
            "divergence_length" + ("_held_out" if args.held_out else "") + ("_quick" if args.quick else ""))
    write_result(name, {"env": env_info(), "quick": args.quick, "held_out": args.held_out, "lengths": lengths,
                        "seconds": took, "config": repr(config), "results": res, "totals": tot, "summary": summary})
    print(f"written bench/results/{name}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
