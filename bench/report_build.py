"""`rldiag report` at scale: 10 runs x 8 metrics x 20k steps (1.6 M points) with injected NaN, inf and spikes.

    python -m bench.report_build [--runs 10] [--metrics 8] [--steps 20000] [--rounds 3] [--quick]

Times `rldiag.app.report.build.build_report(uri, group=...)` end to end (find the runs, load every point, detect
divergence per candidate and metric, build the figures, render the HTML and Markdown), and its two
halves (`load_histories`, `render_report`); measures the HTML's size; then checks the figure data:
every injected NaN and +inf step is a marker of its run, and every spike (up and down, at least 200
steps apart so that no two share a display bucket) is a point of its run's line at its value.
Goals: <= 5 s to build, <= 8 MB of HTML, nothing lost.

The store is made once by MLflow (schema, experiment, runs, tags) and filled by direct SQL inserts,
then cached under /tmp: group `bench-report`, runs 0-2 references, the rest candidates; candidate 3
departs in ratio mean at 60% of the steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

import bench  # noqa: F401 - sets MLFLOW_DISABLE_TELEMETRY
from bench._common import env_info, metric_store, quiet_mlflow, summary_row, write_result
from rldiag.collectors import keys

NAME = "report_build"
GOAL_S = 5.0
GOAL_MB = 8.0
CACHE = Path(tempfile.gettempdir()) / "rldiag-bench"
METRICS = (keys.CLIP_RATE, keys.RATIO_MEAN, keys.KL_NEW_OLD, keys.ENTROPY, keys.REWARD_MEAN,
           keys.MISMATCH_LOGPROB_MEAN, keys.GRAD_NORM, keys.LOSS)
EXPERIMENT, GROUP = "bench-report", "bench-report"
N_REFS, SHIFTED = 3, 3


def injected(run_no: int, key_no: int, steps: int) -> dict[str, np.ndarray]:
    """The steps where run `run_no`'s metric `key_no` is NaN, +inf, spiked up and down (deterministic)."""
    rng = np.random.default_rng(1000 * run_no + key_no)
    slots = rng.permutation(np.arange(1, steps // 200 - 1))[:40] * 200 + rng.integers(0, 50)  # >= 200 apart
    nan = np.sort(slots[:8]) if run_no >= N_REFS else np.empty(0, np.int64)  # candidates only
    inf = np.sort(slots[8:10]) if run_no >= N_REFS and METRICS[key_no] == keys.GRAD_NORM else np.empty(0, np.int64)
    return {"nan": nan, "posinf": inf, "up": np.sort(slots[10:25]), "down": np.sort(slots[25:40])}


def values(run_no: int, key_no: int, steps: int) -> np.ndarray:
    rng = np.random.default_rng(run_no * 31 + key_no)
    v = 1.0 + key_no + rng.normal(0, 0.01, steps) + 0.002 * np.sin(np.arange(steps) / 500)
    if run_no == SHIFTED and METRICS[key_no] == keys.RATIO_MEAN:
        v[int(steps * 0.6):] += 0.05
    inj = injected(run_no, key_no, steps)
    v[inj["up"]] += 1.0  # 100 sigma
    v[inj["down"]] -= 1.0
    v[inj["nan"]] = np.nan
    v[inj["posinf"]] = np.inf
    return v


def build_store(path: Path, n_runs: int, n_metrics: int, steps: int) -> tuple[str, list[str]]:
    """The benchmark's MLflow SQLite store at `path` (cached); returns (uri, run ids by run number)."""
    runs = [(f"run-{i:02d}", {keys.TAG_GROUP: GROUP, keys.TAG_ROLE: "reference" if i < N_REFS else "candidate",
                              keys.TAG_SEED: str(i)},
             {"engine.logprobs_mode": "processed_logprobs" if i == SHIFTED else "raw_logprobs"})
            for i in range(n_runs)]
    return metric_store(path, EXPERIMENT, runs, METRICS[:n_metrics], steps, lambda i, k, _key: values(i, k, steps))

def check_figures(report, ids: list[str], n_metrics: int, steps: int) -> dict:
    """Every injected NaN/+inf step a marker, every spike a line point at its value; what is missing, listed."""
    from rldiag.app.plots.figures import NAN_SUFFIX, POSINF_SUFFIX, trace_names

    labels = report.labels
    kept = {"nan": 0, "posinf": 0, "spikes": 0}
    lost: list[str] = []
    for k, key in enumerate(METRICS[:n_metrics]):
        fig = report.figures[key]
        by_name = dict(zip(trace_names(fig), fig.data))
        for i, rid in enumerate(ids):
            inj, name = injected(i, k, steps), labels[rid]
            for kind, suffix in (("nan", NAN_SUFFIX), ("posinf", POSINF_SUFFIX)):
                if len(inj[kind]):
                    marks = by_name.get(name + suffix)
                    got = np.asarray(marks.x if marks is not None else [], np.int64)
                    if np.array_equal(got, inj[kind]):
                        kept[kind] += len(got)
                    else:
                        lost.append(f"{name} {key} {kind}: {inj[kind].tolist()} vs {got.tolist()}")
            line = by_name[name]
            x, y = np.asarray(line.x, np.int64), np.asarray(line.y, np.float64)
            expected = values(i, k, steps)
            for s in np.concatenate([inj["up"], inj["down"]]):
                j = np.searchsorted(x, s)
                if j < len(x) and x[j] == s and np.isclose(y[j], expected[s], rtol=1e-6):
                    kept["spikes"] += 1
                else:
                    lost.append(f"{name} {key} spike at {s}")
    return {"kept": kept, "lost": lost}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--metrics", type=int, default=8, choices=range(1, len(METRICS) + 1))
    ap.add_argument("--steps", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=3, help="timed end-to-end builds (the median is reported)")
    ap.add_argument("--quick", action="store_true", help="one timed round")
    args = ap.parse_args(argv)
    rounds = 1 if args.quick else args.rounds
    quiet_mlflow()
    from rldiag.app.data.histories import load_histories
    from rldiag.app.data.store import open_store
    from rldiag.app.report.build import build_report, render_report

    CACHE.mkdir(parents=True, exist_ok=True)
    path = CACHE / f"report-{args.runs}x{args.metrics}x{args.steps}.db"
    t0 = time.perf_counter()
    uri, ids = build_store(path, args.runs, args.metrics, args.steps)
    print(f"store {path} ({path.stat().st_size / 1e6:.0f} MB) ready in {time.perf_counter() - t0:.1f} s")
    metric_keys = list(METRICS[: args.metrics])

    build_report(uri, group=GROUP)  # warm-up: page cache, imports, plotly.js read once per process
    totals, cpus = [], []
    for _ in range(rounds):
        t0, c0 = time.perf_counter(), time.process_time()
        report = build_report(uri, group=GROUP)
        totals.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)  # all threads: on a shared machine, the part that is ours
    store = open_store(uri)
    t0, c0 = time.perf_counter(), time.process_time()
    h = load_histories(store, ids, [*metric_keys, keys.GRAD_FINITE])
    load_s, load_cpu = time.perf_counter() - t0, time.process_time() - c0
    t0, c0 = time.perf_counter(), time.process_time()
    render_report(h, store, ids[:N_REFS], ids[N_REFS:], keys=metric_keys)
    render_s, render_cpu = time.perf_counter() - t0, time.process_time() - c0

    build_s = statistics.median(totals)
    html_mb = len(report.html.encode()) / 1e6
    md_kb = len(report.markdown.encode()) / 1e3
    check = check_figures(report, ids, args.metrics, args.steps)
    div = report.divergence
    onset = div[(div.run_id == ids[SHIFTED]) & (div.key == keys.RATIO_MEAN)].onset_step.item()
    complete = not check["lost"]
    print(f"build_report      {build_s:6.2f} s median of {[round(t, 2) for t in totals]} (goal <= {GOAL_S} s), "
          f"CPU {statistics.median(cpus):.2f} s; load {load_s:.2f} s (CPU {load_cpu:.2f}), render {render_s:.2f} s "
          f"(CPU {render_cpu:.2f}); load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"HTML              {html_mb:6.2f} MB (goal <= {GOAL_MB} MB); Markdown {md_kb:.1f} kB")
    print(f"figure data       kept {check['kept']}, lost {len(check['lost'])} {check['lost'][:5]}")
    print(f"divergence        run-03 ratio mean onset {onset} (shift at {int(args.steps * 0.6)})")
    result = {
        "env": env_info(), "quick": args.quick, "runs": args.runs, "metrics": args.metrics, "steps": args.steps,
        "points": args.runs * args.metrics * args.steps, "build_s": totals, "build_cpu_s": cpus, "load_s": load_s,
        "load_cpu_s": load_cpu, "render_s": render_s, "render_cpu_s": render_cpu, "loadavg": os.getloadavg()[0],
        "html_bytes": len(report.html.encode()), "markdown_bytes": len(report.markdown.encode()),
        "kept": check["kept"], "lost": check["lost"], "shifted_onset_step": onset,
        "summary": [
            summary_row(f"report build, {args.runs} runs x {args.metrics} metrics x {args.steps // 1000}k steps",
                        f"{build_s:.2f} s (CPU {statistics.median(cpus):.2f} s)", "-", "-", f"<= {GOAL_S:g} s",
                        build_s <= GOAL_S),
            summary_row("report HTML size (plotly.js included)", f"{html_mb:.1f} MB", "-", "-", f"<= {GOAL_MB:g} MB",
                        html_mb <= GOAL_MB),
            summary_row("report keeps every NaN/inf/spike", f"{sum(check['kept'].values())} kept, "
                        f"{len(check['lost'])} lost", "-", "-", "0 lost", complete),
        ],
    }
    print(f"results: {write_result(NAME, result)}")
    return result


if __name__ == "__main__":
    main()
