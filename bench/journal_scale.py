"""Journal scale: bytes on disk during a long run, and the RAM and time of a restart's replay.

    python -m bench.journal_scale                    # 20k steps x 50 metrics (1 M points), ~2 min
    python -m bench.journal_scale --steps 1000000    # the issue's size: 50 M points (hours here; old ~2.7 GB)

Before vs after, each in its own child process: "before" is the write path at commit e89392e (the
last before segments: one journal file kept until a clean close, a restart parses all of it), loaded
from git into the child in place of today's `journal` and `writer` modules; "after" is this tree.

The run: `--steps` steps of 50 metrics, as fast as the loop goes; the store takes everything for the
first 90% of the steps (the loop waits for delivery every 500 steps: it is faster than any training
step, and the store keeps up with a real one) and is down (connection refused) for the last 10%; once
those are journaled the process dies without closing (`os._exit`, as a SIGKILL would). The store is a null one, named as such: it takes a
call at once, so that what is measured is the journal alone (a real SQLite store takes ~50k points/s
on 2 cores: 1 M steps would take hours and only make the backlog bigger). Measured: the journal's
peak bytes on disk (sampled every 200 steps), the writer process's peak RSS, the training thread's log
call (median, p99, max). Then a restart of the run in a fresh process: peak RSS and seconds until the
undelivered 10% is delivered (to the null store) and the writer closed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench  # noqa: F401 - sets MLFLOW_DISABLE_TELEMETRY
from bench._common import env_info, summarize_ms, summary_row, write_result

BEFORE = "e89392e"
KEYS = [f"train/metric_{i:02d}" for i in range(50)]
REPO = Path(__file__).resolve().parent.parent


def _load_before(code_dir: Path) -> None:
    """Today's rldiag, but with the journal and writer of commit BEFORE (both files from git)."""
    import rldiag.collectors  # noqa: F401 - the package first, then its two old modules in its place

    for name in ("journal", "writer"):
        spec = importlib.util.spec_from_file_location(f"rldiag.collectors.{name}", code_dir / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)


def _reset_peak_rss() -> None:
    """Start the peak-RSS count afresh (Linux: clear_refs 5 resets VmHWM), so that the imports' peak
    (torch) does not hide the writer's."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _rss_mb(field: str = "VmHWM") -> float:
    """Peak (VmHWM) or current (VmRSS) resident memory of this process, in MB."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _dir_bytes(d: Path) -> int:
    try:
        return sum(e.stat().st_size for e in os.scandir(d) if e.is_file())
    except FileNotFoundError:
        return 0


class NullStore:
    """Takes every call at once (a stand-in for a fast store), or refuses the connection while down."""

    def __init__(self) -> None:
        self.down = False
        self.points = 0

    def __call__(self, run_id, metrics, tags) -> None:
        if self.down:
            raise ConnectionRefusedError(111, "Connection refused")
        self.points += len(metrics)


def child_run(args) -> dict:
    from rldiag.collectors.writer import MetricWriter

    store = NullStore()
    spill = Path(args.spill)
    _reset_peak_rss()
    base = _rss_mb("VmRSS")
    w = MetricWriter("bench-run", store, spill_dir=spill, backoff_s=(0.05, 0.5))
    calls, peak_bytes = [], 0
    down_at = int(args.steps * 0.9)
    clock = time.perf_counter
    for step in range(args.steps):
        if step == down_at:
            if not w.flush(3600):
                raise SystemExit("the null store did not take the first 90%")
            store.down = True
        elif step < down_at and step % 500 == 499:
            w.flush(3600)  # the store keeps up, as it does at a training step's pace (this loop is faster)
        values = {k: step + i * 1e-3 for i, k in enumerate(KEYS)}
        t0 = clock()
        w.log_metrics(values, step)
        calls.append(clock() - t0)
        if step % 200 == 0:
            peak_bytes = max(peak_bytes, _dir_bytes(spill))
    while not w._q.empty():  # the last steps reach the journal
        time.sleep(0.1)
        peak_bytes = max(peak_bytes, _dir_bytes(spill))
    time.sleep(1.0)
    peak_bytes = max(peak_bytes, _dir_bytes(spill))
    out = {"steps": args.steps, "points": args.steps * len(KEYS), "delivered": store.points,
           "journal_peak_bytes": peak_bytes, "journal_end_bytes": _dir_bytes(spill),
           "rss_start_mb": base, "rss_peak_mb": _rss_mb(), "log_call": summarize_ms(calls)}
    print(json.dumps(out), flush=True)
    os._exit(0)  # dies without close(), as a SIGKILLed trainer does


def child_restart(args) -> dict:
    from rldiag.collectors.writer import MetricWriter

    store = NullStore()
    _reset_peak_rss()
    base = _rss_mb("VmRSS")
    t0 = time.perf_counter()
    w = MetricWriter("bench-run", store, spill_dir=Path(args.spill))
    stats = w.close(timeout=3600)
    took = time.perf_counter() - t0
    out = {"seconds": took, "rss_start_mb": base, "rss_peak_mb": _rss_mb(), "replayed": stats.replayed,
           "undelivered": stats.undelivered}
    print(json.dumps(out), flush=True)
    return out


def _child(which: str, version: str, steps: int, spill: Path, code_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "bench.journal_scale", "--child", which, "--version", version,
           "--steps", str(steps), "--spill", str(spill), "--code", str(code_dir)]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"bench.journal_scale child {which}/{version} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20_000, help="training steps of 50 metrics (default 20000)")
    ap.add_argument("--quick", action="store_true", help="2000 steps")
    ap.add_argument("--child", choices=("run", "restart"), help=argparse.SUPPRESS)
    ap.add_argument("--version", choices=("before", "after"), default="after", help=argparse.SUPPRESS)
    ap.add_argument("--spill", help=argparse.SUPPRESS)
    ap.add_argument("--code", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        if args.version == "before":
            _load_before(Path(args.code))
        (child_run if args.child == "run" else child_restart)(args)
        return 0
    steps = 2000 if args.quick else args.steps
    results: dict = {"env": env_info(), "quick": args.quick, "steps": steps, "metrics_per_step": len(KEYS),
                     "before_commit": BEFORE}
    with tempfile.TemporaryDirectory(prefix="rldiag-journal-scale-") as tmp:
        code = Path(tmp) / "before"
        code.mkdir()
        for name in ("journal", "writer"):
            src = subprocess.run(["git", "show", f"{BEFORE}:collectors/{name}.py"], cwd=REPO, capture_output=True,
                                 text=True, check=True).stdout
            (code / f"{name}.py").write_text(src)
        for version in ("before", "after"):
            spill = Path(tmp) / f"spill-{version}"
            print(f"{version}: {steps} steps x {len(KEYS)} metrics ...", flush=True)
            run = _child("run", version, steps, spill, code)
            restart = _child("restart", version, steps, spill, code)
            results[version] = {"run": run, "restart": restart}
            print(f"  journal peak {run['journal_peak_bytes'] / 1e6:.1f} MB, writer RSS {run['rss_peak_mb']:.0f} MB, "
                  f"log call median {run['log_call']['median_ms'] * 1e3:.1f} us p99 {run['log_call']['p99_ms'] * 1e3:.1f}"
                  f" us; restart {restart['seconds']:.2f} s, RSS {restart['rss_peak_mb']:.0f} MB "
                  f"({restart['replayed']} points replayed)", flush=True)
    b, a = results["before"], results["after"]
    ratio_disk = b["run"]["journal_peak_bytes"] / max(1, a["run"]["journal_peak_bytes"])
    ratio_rss = (b["restart"]["rss_peak_mb"] - b["restart"]["rss_start_mb"]) / max(
        1e-3, a["restart"]["rss_peak_mb"] - a["restart"]["rss_start_mb"])
    ratio_t = b["restart"]["seconds"] / max(1e-6, a["restart"]["seconds"])
    undelivered_bytes = a["run"]["journal_end_bytes"]
    results["summary"] = [
        summary_row(f"journal on disk, {steps} steps x 50 metrics (peak)", f"{a['run']['journal_peak_bytes'] / 1e6:.1f} MB",
                    f"{b['run']['journal_peak_bytes'] / 1e6:.1f} MB (before, one file kept)", f"{ratio_disk:.1f}x smaller",
                    "undelivered + one segment", a["run"]["journal_peak_bytes"] <= undelivered_bytes + (4 << 20) + 1e5),
        summary_row("restart replay of that journal (RSS growth, time)",
                    f"{a['restart']['rss_peak_mb'] - a['restart']['rss_start_mb']:.0f} MB, {a['restart']['seconds']:.1f} s",
                    f"{b['restart']['rss_peak_mb'] - b['restart']['rss_start_mb']:.0f} MB, {b['restart']['seconds']:.1f} s",
                    f"{ratio_rss:.1f}x less RAM, {ratio_t:.1f}x faster", "streams only undelivered",
                    a["restart"]["replayed"] == b["restart"]["replayed"]),
    ]
    path = write_result("journal_scale", results)
    print(f"wrote {path}")
    for row in results["summary"]:
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
