"""Dashboard page load: 10 runs x 8 metrics x 100k steps (8 M points) with NaN and spikes injected,
from `rldiag app`'s server to every chart drawn in headless Chromium.

    python -m bench.dashboard_load [--runs 10] [--metrics 8] [--steps 100000] [--loads 3] [--no-busy] [--quick]

The store is made once by MLflow (schema, experiment, runs, tags: run 0 the reference, the others
candidates of one group) and filled by direct SQL inserts (8 M points through `log_batch` would take
about 12 minutes), then cached under /tmp (not in the repository). Every run gets NaN at 3 steps of
`grad/norm` and a one-step spike (+30 in a random walk of step sd 0.01) in one metric.

Timed: `page.goto(<app>/compare)` until every metric's panel holds every run's line (in plotly's
`_fullData`), in a new browser page (and context: nothing in the browser's cache) each time, against
the server `rldiag app` starts (`rldiag.app.dashboard.serve`), with a fresh disk cache
(RLDIAG_CACHE_DIR, a temp dir):
- "first": the first load ever: it reads the 8 M points and computes the divergence of 9 candidates
  x 8 metrics, and the server keeps them in its disk cache; it draws the charts before the verdicts
  (`early_charts_drawn`) and is timed until the verdicts and the full charts replaced them;
- "cold": the server is stopped and started again (a new process: nothing in memory), then the first
  load: from the disk cache, checked against the store (goal <= 5 s);
- "warm": the loads after it, from the server's memory (goal <= 3 s);
- "warm, same browser": then as many loads in one browser context after an untimed one, as a user who
  reloads the page has it (Streamlit's and plotly.js's scripts from the browser's HTTP and code caches):
  reported beside the goal's figure, which stays the fresh browser's;
- then "cold" and "warm" again, with another process using one core (`python -c 'while 1: pass'`, as a
  training job or a test run beside the dashboard would): the same goals (`--no-busy` skips it).
The server's start (launch to healthy) and the machine's load average before each server are reported beside
them, and the CPU seconds other processes used during each session (`others_cpu`: every process but this one
and its descendants): the busy-core figure is only that where this is near 0. The first load must show its
progress bar (runs and points read) before any chart: the seconds until it shows are reported. Each load's
timeline is printed: seconds to the websocket connected, the script run started and finished (as the page
shows them) and every chart drawn, with the chart component's own marks (app/dashboard/static/chart_grid.js):
when it got its figure, and the seconds plotly.js took to parse and to draw it; and the CPU seconds the load
took in the page's renderer (its main thread and all of it, from Chromium's Performance metrics) and in the
server's process group: a busy machine stretches the seconds, much less the CPU. Then every injected NaN and
spike is checked in the drawn data, after the cold and after the warm loads. `--quick` (20k steps) writes its
result beside the full one (dashboard_load_quick.json), not over it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

import bench  # noqa: F401 - sets MLFLOW_DISABLE_TELEMETRY
from bench._common import env_info, metric_store, quiet_mlflow, summary_row, write_result
from bench._server import group_cpu_s, others_cpu, others_cpu_s, start_dashboard, stop_group
from rldiag.collectors import keys
from tests.helpers.browser import chromium, drawn_panels_js

NAME = "dashboard_load"
GOAL_COLD_S = 5.0
GOAL_WARM_S = 3.0
CACHE = Path(tempfile.gettempdir()) / "rldiag-bench"
METRICS = (keys.RATIO_MEAN, keys.CLIP_RATE, keys.KL_NEW_OLD, keys.ENTROPY, keys.REWARD_MEAN,
           keys.MISMATCH_LOGPROB_MEAN, keys.GRAD_NORM, keys.LOSS)
EXPERIMENT = "bench-dashboard"
SPIKE = 30.0
VIEWPORT = {"width": 1500, "height": 1100}
REPO = Path(__file__).resolve().parent.parent
# The first load's progress bar (app/dashboard/data.py ProgressBar): its text, once Streamlit draws it.
PROGRESS_JS = """() => { const p = document.querySelector('[data-testid="stProgress"]'); return p ? p.innerText : null; }"""
# The first load is done: its script run finished and the charts drawn before the verdicts replaced
# (app/dashboard/compare.py's "Verdicts being computed..." caption gone with them).
FIRST_DONE_JS = """() => !!(window.__rldiagMarks || {}).script_done
    && !document.body.innerText.includes('Verdicts being computed')"""
# Polled every 50 ms: names only (copying every trace's arrays on each poll slowed the page it timed).
NAMES_JS = drawn_panels_js("name: t.name")
DRAWN_JS = drawn_panels_js("name: t.name, x: Array.from(t.x || []), y: Array.from(t.y || [])")
# The load's timeline, in ms since navigation: websocket connected, script run started and finished (as
# the page shows them). Observes the app element's two attributes only, not the page's every change.
MARKS_JS = """(() => {
  const marks = window.__rldiagMarks = {};
  const watch = (app) => new MutationObserver(() => {
    const now = performance.now(), state = app.getAttribute('data-test-script-state');
    if (!marks.connected && app.getAttribute('data-test-connection-state') === 'CONNECTED') marks.connected = now;
    if (!marks.script_started && state === 'running') marks.script_started = now;
    if (marks.script_started && !marks.script_done && state === 'notRunning') marks.script_done = now;
  }).observe(app, {attributes: true, attributeFilter: ['data-test-connection-state', 'data-test-script-state']});
  const find = new MutationObserver(() => {
    const app = document.querySelector('[data-testid="stApp"]');
    if (app) { find.disconnect(); watch(app); }
  });
  find.observe(document, {childList: true, subtree: true});
})()"""

# From app/dashboard/static/chart_grid.js: when the chart component got its figure (its plotly.js bundle
# evaluated by then), and how long parsing and drawing the figure took; the last draw of the page.
CHART_MARKS_JS = """() => {
  const last = (name) => performance.getEntriesByName(name).at(-1);
  const start = last('rldiag.chart_grid.start'), parse = last('rldiag.chart_grid.parse'),
        draw = last('rldiag.chart_grid.draw');
  return start ? {chart_start: start.startTime, chart_parse_s: parse.duration, chart_draw_s: draw.duration} : {};
}"""


def injected(n_runs: int, n_metrics: int, steps: int) -> dict[str, dict]:
    """Per run name: its NaN steps (grad/norm) and its spike (metric, step), from fixed seeds."""
    out = {}
    for i in range(n_runs):
        rng = np.random.default_rng(1000 + i)
        out[f"run-{i:02d}"] = {
            "nan_steps": sorted(int(s) for s in rng.choice(np.arange(1, steps - 1), 3, replace=False)),
            "spike": (METRICS[: n_metrics][i % n_metrics], int(rng.integers(1, steps - 1))),
        }
    return out


def build_store(path: Path, n_runs: int, n_metrics: int, steps: int) -> str:
    """The benchmark's MLflow SQLite store at `path` (built once, then reused)."""
    plan = injected(n_runs, n_metrics, steps)
    names = list(plan)

    def series(run_no: int, key_no: int, key: str) -> np.ndarray:
        inj = plan[names[run_no]]
        vals = np.cumsum(np.random.default_rng(run_no * 1000 + key_no).normal(0, 0.01, steps)) + key_no
        if key == inj["spike"][0]:
            vals[inj["spike"][1]] += SPIKE
        if key == keys.GRAD_NORM:
            vals[inj["nan_steps"]] = np.nan
        return vals

    runs = [(name, {keys.TAG_GROUP: "bench", keys.TAG_ROLE: "reference" if i == 0 else "candidate",
                    keys.TAG_SEED: str(i)}, {}) for i, name in enumerate(names)]
    return metric_store(path, EXPERIMENT, runs, METRICS[:n_metrics], steps, series)[0]

def serve(uri: str, log: Path, cache_dir: Path) -> tuple[subprocess.Popen, str, float]:
    """`rldiag app` with `cache_dir` as its disk cache; the process, its URL and the seconds from launch
    to healthy."""
    return start_dashboard(uri, log, env={"RLDIAG_CACHE_DIR": str(cache_dir)}, timeout=300)


@contextmanager
def busy_core(on: bool = True):
    """Another process using one core for as long as the block runs (nothing when `on` is false)."""
    if not on:
        yield
        return
    proc = subprocess.Popen([sys.executable, "-c", "while 1: pass"], start_new_session=True)
    try:
        yield
    finally:
        stop_group(proc, timeout=5)


def server_loads(uri: str, log: Path, cache_dir: Path, runs: list[str], n_charts: int, n: int, *,
                 first: bool = False, same_browser: int = 0) -> tuple[float, list[tuple[float, dict, list[dict]]]]:
    """Start `rldiag app`, time `n` page loads in a row, each in a fresh browser context, then (with
    `same_browser`) an untimed load and `same_browser` timed ones in one context; stop it; its start seconds
    and each load's (seconds, timeline, charts drawn), the same-browser ones last. `first`: the first load
    reads the store (1800 s allowed) and must show its progress bar."""
    proc, url, start = serve(uri, log, cache_dir)
    try:
        with chromium() as browser:
            out = [load_page(browser, url, runs, n_charts, timeout_s=1800 if first and i == 0 else 300,
                             progress=first and i == 0, server_group=proc.pid) for i in range(n)]
            if same_browser:
                context = browser.new_context(viewport=VIEWPORT)
                try:
                    loads = [load_page(browser, url, runs, n_charts, 300, server_group=proc.pid, context=context)
                             for _ in range(1 + same_browser)]
                finally:
                    context.close()
                out += loads[1:]
            return start, out
    finally:
        stop_group(proc, timeout=30)


def settle(cache_dir: Path, timeout_s: float = 300) -> int:
    """Wait until the server's background writes to its disk cache are done (no half-written file
    and the same bytes for 2 s); returns the cache's bytes."""
    last, since = -1, time.monotonic()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        files = [f for f in cache_dir.rglob("*") if f.is_file()]
        size = sum(f.stat().st_size for f in files)
        if any(f.name.endswith(".tmp") for f in files) or size != last:
            last, since = size, time.monotonic()
        elif time.monotonic() - since > 2:
            return size
        time.sleep(0.2)
    raise RuntimeError(f"the disk cache in {cache_dir} did not settle in {timeout_s} s")


def load_page(browser, url: str, runs: list[str], n_charts: int, timeout_s: float, progress: bool = False,
              server_group: int | None = None, context=None) -> tuple[float, dict, list[dict]]:
    """Seconds from navigation until `n_charts` panels hold every run's line; the load's timeline
    (seconds: connected, script_started, script_done, drawn; with `progress`, when the progress bar
    first showed and its last text seen); and what the charts drew. The timeline also holds the CPU
    seconds the load took: the page's renderer (Chromium's ThreadTime, its main thread, and ProcessTime)
    and the server (`server_group`, its process group); CPU is what a busy machine shares, so these
    move less with other work than the seconds do. `context`: a browser context to open the page in (its
    caches kept between loads); else a new one."""
    page = context.new_page() if context is not None else browser.new_page(viewport=VIEWPORT)
    page.add_init_script(MARKS_JS)
    cdp = page.context.new_cdp_session(page)
    cdp.send("Performance.enable")

    def cpu() -> dict[str, float]:
        metrics = {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}
        out = {k: metrics[m] for k, m in (("renderer_main", "ThreadTime"), ("renderer", "ProcessTime")) if m in metrics}
        return {**out, "server": group_cpu_s(server_group)} if server_group else out

    bar: dict = {}
    try:
        cpu0 = cpu()
        t0 = time.perf_counter()
        page.goto(url + "compare")
        while True:
            names = [{t["name"] for t in panel["traces"]} for panel in page.evaluate(NAMES_JS)]
            if progress and (text := page.evaluate(PROGRESS_JS)):
                bar.setdefault("progress_shown", round(time.perf_counter() - t0, 2))
                bar["progress_text"] = text
            charts_in = len(names) >= n_charts and all(set(runs) <= n for n in names)
            if charts_in and progress:  # a first load draws its charts before the verdicts: timed to the whole page
                bar.setdefault("early_charts_drawn", round(time.perf_counter() - t0, 2))
                charts_in = page.evaluate(FIRST_DONE_JS)
            if charts_in:
                took = time.perf_counter() - t0
                cpu1 = cpu()
                marks = {k: round(v / 1000, 2) for k, v in page.evaluate("window.__rldiagMarks").items()}
                marks.update({f"{k}_cpu_s": round(cpu1[k] - cpu0[k], 2) for k in cpu0 if k in cpu1})
                marks.update({k: round(v / 1000, 2) for k, v in page.evaluate(CHART_MARKS_JS).items()})
                # what was drawn, read once, after the clock stopped
                return took, {**marks, **bar, "drawn": round(took, 2)}, page.evaluate(DRAWN_JS)
            if time.perf_counter() - t0 > timeout_s:
                raise RuntimeError(f"{len(names)} of {n_charts} panels drawn after {timeout_s} s")
            page.wait_for_timeout(50)
    finally:
        page.close()


def check_visible(charts: list[dict], plan: dict[str, dict]) -> dict[str, list]:
    """Every injected NaN as a marker and every spike as a drawn point of its run's line."""
    # a panel's title is its metric, then any notes (" · bands of the first 3 of 9 to alert")
    by_title = {c["title"].split(" · ")[0]: {t["name"]: t for t in c["traces"]} for c in charts}
    missing_nan, missing_spike = [], []
    for run, inj in plan.items():
        marker = by_title.get(keys.GRAD_NORM, {}).get(run + " NaN")
        if marker is None or sorted(int(x) for x in marker["x"]) != inj["nan_steps"]:
            missing_nan.append(run)
        key, step = inj["spike"]
        line = by_title.get(key, {}).get(run)
        drawn = dict(zip((int(x) for x in line["x"]), line["y"])) if line else {}
        if step not in drawn or drawn[step] < SPIKE / 2:
            missing_spike.append(run)
    return {"missing_nan": missing_nan, "missing_spike": missing_spike}


CPU_KEYS = ("renderer_main_cpu_s", "renderer_cpu_s", "server_cpu_s")  # load_page's CPU seconds a load


def load_average() -> float:
    """The machine's 1-minute load average (other work sharing its cores)."""
    return round(os.getloadavg()[0], 2)


def timed_session(uri: str, log: Path, cache_dir: Path, plan: dict[str, dict], n_charts: int, loads: int,
                  busy: bool) -> dict:
    """A new server over the disk cache: its cold load, then `loads` warm ones (with another process on
    one core when `busy`); the timings, timelines and whether every NaN and spike was drawn."""
    runs = list(plan)
    load_before = load_average()
    others, t0 = others_cpu(), time.monotonic()
    with busy_core(busy):
        start, timed = server_loads(uri, log, cache_dir, runs, n_charts, 1 + loads, same_browser=loads)
    others = {"cpu_s": others_cpu_s(others, others_cpu()), "in_s": round(time.monotonic() - t0, 1)}
    (cold, cold_marks, cold_charts), *rest = timed
    rest, same = rest[:loads], rest[loads:]
    label = "with one core busy" if busy else "no process of its own beside it"
    print(f"[{label}] other work on the machine meanwhile: {others['cpu_s']} CPU seconds in {others['in_s']} s")
    print(f"[{label}, load average {load_before}] server up in {start:.2f} s; cold page load (new process, from "
          f"the disk cache): {cold:.2f} s {cold_marks}")
    for t, marks, _ in rest:
        print(f"[{label}] warm page load: {t:.2f} s {marks}")
    for t, marks, _ in same:
        print(f"[{label}] warm page load, same browser: {t:.2f} s {marks}")
    visible, visible_cold = check_visible(rest[-1][2], plan), check_visible(cold_charts, plan)
    return {"load_average_before": load_before, "other_work": others, "server_start_s": start, "cold_s": cold,
            "cold_timeline_s": cold_marks,
            "warm_s": [t for t, _, _ in rest], "warm_timelines_s": [m for _, m, _ in rest],
            "warm_median_s": statistics.median(t for t, _, _ in rest),
            "warm_cpu_median_s": {k: round(statistics.median(m[k] for _, m, _ in rest), 2) for k in CPU_KEYS
                                  if all(k in m for _, m, _ in rest)},
            "warm_same_browser_s": [t for t, _, _ in same],
            "warm_same_browser_median_s": statistics.median(t for t, _, _ in same) if same else None,
            "warm_same_browser_cpu_median_s": {k: round(statistics.median(m[k] for _, m, _ in same), 2)
                                               for k in CPU_KEYS if same and all(k in m for _, m, _ in same)},
            "drawn_points": sum(len(t["x"]) for c in rest[-1][2] for t in c["traces"]), "charts": len(rest[-1][2]),
            "all_visible": not any(visible.values()) and not any(visible_cold.values()),
            "missing_cold": visible_cold, **visible}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--metrics", type=int, default=8, choices=range(1, len(METRICS) + 1))
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--loads", type=int, default=3, help="warm page loads timed after the cold one")
    ap.add_argument("--quick", action="store_true", help="20k steps")
    ap.add_argument("--no-busy", action="store_true", help="skip the loads with another process using one core")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps = 20_000
    quiet_mlflow()
    CACHE.mkdir(parents=True, exist_ok=True)
    path = CACHE / f"dashboard-{args.runs}x{args.metrics}x{args.steps}.db"
    t0 = time.perf_counter()
    uri = build_store(path, args.runs, args.metrics, args.steps)
    print(f"store {path} ({path.stat().st_size / 1e6:.0f} MB) ready in {time.perf_counter() - t0:.1f} s", flush=True)
    plan = injected(args.runs, args.metrics, args.steps)
    log = CACHE / "dashboard-app.log"
    cache_dir = Path(tempfile.mkdtemp(prefix="rldiag-bench-disk-cache-"))
    try:
        # the first server: the first load ever, then its disk cache written
        load_first = load_average()
        (start_first, [(first, first_marks, _)]) = server_loads(uri, log, cache_dir, list(plan), args.metrics, 1,
                                                                first=True)
        print(f"[load average {load_first}] server up in {start_first:.2f} s; first load ever (reads "
              f"{args.runs * args.metrics * args.steps:,} points, computes the divergence): {first:.2f} s "
              f"{first_marks}", flush=True)
        cache_bytes = settle(cache_dir)
        print(f"disk cache: {cache_bytes / 1e6:.0f} MB; server stopped, started again", flush=True)
        # a new server process over that cache: the cold load, then the warm ones; then again, one core busy
        quiet = timed_session(uri, log, cache_dir, plan, args.metrics, args.loads, busy=False)
        busy = None if args.no_busy else timed_session(uri, log, cache_dir, plan, args.metrics, args.loads, busy=True)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    ok = quiet["all_visible"] and (busy is None or busy["all_visible"])
    print(f"every NaN and spike drawn (cold and warm): {ok}; {quiet['drawn_points']} points drawn in "
          f"{quiet['charts']} metric panels; the first load's progress bar showed at "
          f"{first_marks.get('progress_shown', 'never')} s")
    rows = []
    for name, r in [("", quiet), (", another process using one core", busy)]:
        if r is None:
            continue
        cold, median = r["cold_s"], r["warm_median_s"]
        print(f"cold page load{name} {cold:.2f} s (goal <= {GOAL_COLD_S} s): {'met' if cold <= GOAL_COLD_S else 'NOT met'}; "
              f"warm median {median:.2f} s (goal <= {GOAL_WARM_S} s): {'met' if median <= GOAL_WARM_S else 'NOT met'}"
              f" (load average {r['load_average_before']} before); CPU a warm load (median): {r['warm_cpu_median_s']};"
              f" warm in the same browser (median): {r['warm_same_browser_median_s']:.2f} s, CPU "
              f"{r['warm_same_browser_cpu_median_s']}")
        rows += [
            summary_row(f"dashboard cold start{name}: a new server process, first page load, from the disk cache",
                        f"{cold:.2f} s", f"{first:.1f} s (no cache: reads the store)", f"{first / cold:.1f}x faster",
                        f"<= {GOAL_COLD_S} s, every NaN/spike drawn", cold <= GOAL_COLD_S and r["all_visible"]),
            summary_row(f"dashboard page load to {args.metrics} metric panels drawn, warm server{name}",
                        f"{median:.2f} s", "-", "-", f"<= {GOAL_WARM_S} s, every NaN/spike drawn",
                        median <= GOAL_WARM_S and r["all_visible"]),
            summary_row(f"dashboard page load, warm server, the same browser reloading{name}",
                        f"{r['warm_same_browser_median_s']:.2f} s", f"{median:.2f} s (a fresh browser)", "-",
                        "- (reported: the goal is the fresh browser's)", None),
        ]
    result = {
        "env": env_info(), "runs": args.runs, "metrics": args.metrics, "steps": args.steps,
        "points": args.runs * args.metrics * args.steps, "quick": args.quick,
        "first_s": first, "first_timeline_s": first_marks, "first_load_average_before": load_first,
        "server_start_s": {"first": start_first, "restart": quiet["server_start_s"]},
        "disk_cache_bytes": cache_bytes, **{k: v for k, v in quiet.items() if k != "server_start_s"},
        "busy_core": busy, "all_visible": ok, "summary": rows,
    }
    print(f"results: {write_result(NAME + ('_quick' if args.quick else ''), result)}")
    return result


if __name__ == "__main__":
    main()
