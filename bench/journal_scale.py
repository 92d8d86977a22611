"""Journal scale: bytes on disk, writer RSS and the log call over a long run; a restart's replay; an outage.

    python -m bench.journal_scale                              # 20k steps x 50 metrics (1 M points), ~1 min
    python -m bench.journal_scale --steps 200000               # before vs after, ~10 min (before's replay: 2.4 GB RAM)
    python -m bench.journal_scale --steps 1000000 --only-after # the issue's size (50 M points), ~5 min
    python -m bench.journal_scale --steps 1000000 --outage-s 600   # 1 M steps, 10 minutes down mid-run, ~15 min

Restart (the default): before vs after, each in its own child process: "before" is the write path at
commit e89392e (the last before segments: one journal file kept until a clean close, a restart parses
all of it), loaded from git into the child in place of today's `journal` and `writer` modules; "after"
is this tree. `--only-after` runs today's alone: at 1 M steps the before side keeps a 2.7 GB journal
and its restart parses all of it (about 12 GB of RAM and 6 minutes, more than this shared machine
has to spare), so its figures stay those of the last before-vs-after run (the 200k row). The run:
`--steps` steps of 50 metrics, as fast as the loop goes; the store takes everything for the first 90%
of the steps (the loop waits for delivery every 500 steps: it is faster than any training step, and
the store keeps up with a real one) and is down (connection refused) for the last 10%, which the loop
logs without waiting for the store, only for the writer's ingest queue (`_keep_up_with_ingest`); once
those are journaled the process dies without closing (`os._exit`, as a SIGKILL would). Then a restart of the run
in a fresh process: peak RSS and seconds until the undelivered 10% is delivered and the writer closed.

Outage (`--outage-s S`, today's write path): the store is up for the first 40% of the steps (as
above), down for the middle 20%, which the loop spreads evenly over S seconds of wall time (at 1 M
steps and 600 s: 200k steps, 10 M points, 333 steps/s, so the outage backlog is as large as a fast
trainer makes in 10 minutes), then up again for the last 40%, which the loop logs without waiting for
the store while the backlog drains (it waits only for the writer's ingest queue, as a training loop
slower than ingest would), and back at the store's pace once it has drained. Then the writer flushes
and closes. Measured: points the store took, distinct and duplicated (a bitmap of (step, key)), of
points logged; peak backlog; journal bytes beside the backlog at each sample (the goal: journal at
most the backlog's own journal lines plus one segment, see ENVELOPE); writer peak RSS (goal < 200 MB)
with a sample every 5 s; the log call (during the outage each call follows a sleep of the pacing, so
it runs cold: its median is several times the unpaced one).

The store is a null one, named as such: it takes a call at once, so that what is measured is the
journal and the writer alone (a real SQLite store takes ~50k points/s on 2 cores: 1 M steps would take
hours and only make the backlog bigger). Journal bytes on disk are sampled every 200 steps; peak RSS
is the writer process's VmHWM (reset after the imports), the log-call samples (8 bytes a step) included.
Results go to bench/results/journal_scale.json, one entry per kind of run (compare, after-only, outage),
each replaced by its next run; the README rows come from all of them.
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
from array import array
from pathlib import Path

import bench  # noqa: F401 - sets MLFLOW_DISABLE_TELEMETRY
from bench._common import RESULTS, env_info, summarize_ms, summary_row, write_result

BEFORE = "e89392e"
KEYS = [f"train/metric_{i:02d}" for i in range(50)]
KEY_INDEX = {k: i for i, k in enumerate(KEYS)}
REPO = Path(__file__).resolve().parent.parent
SEGMENT = 4 << 20  # collectors/journal.py's SEGMENT_BYTES (not imported: "before" has none)
# The backlog's own journal lines are estimated as points x one step's bytes a point; the batch lines'
# envelopes ({"seq":N,"n":K,"m":[...]}) and ack lines add ~38 bytes a batch of 800-1000 points (< 0.1%),
# and values' lengths vary from step to step: the goal allows 0.2% of the journal on top of one segment.
ENVELOPE = 0.002


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


def _values(step: int) -> dict[str, float]:
    return {k: step + i * 1e-3 for i, k in enumerate(KEYS)}


class NullStore:
    """Takes every call at once (a stand-in for a fast store), or refuses the connection while down.
    With `steps`, also marks each (step, key) it took in a bitmap (steps x 50 bits), so that what it
    took twice and what it never took can be counted."""

    def __init__(self, steps: int = 0) -> None:
        self.down = False
        self.points = 0
        self.duplicated = 0
        self._bits = bytearray((steps * len(KEYS) + 7) // 8) if steps else None

    def __call__(self, run_id, metrics, tags) -> None:
        if self.down:
            raise ConnectionRefusedError(111, "Connection refused")
        self.points += len(metrics)
        bits = self._bits
        if bits is not None:
            n = len(KEYS)
            for key, _value, _ts, step in metrics:
                i = step * n + KEY_INDEX[key]
                j, m = i >> 3, 1 << (i & 7)
                if bits[j] & m:
                    self.duplicated += 1
                else:
                    bits[j] |= m

    def distinct(self) -> int:
        return int.from_bytes(self._bits, "little").bit_count() if self._bits is not None else -1


def _timed_log(w, step: int) -> float:
    """Seconds the training thread's `log_metrics` of one step took (the values made outside the clock)."""
    values = _values(step)
    t0 = time.perf_counter()
    w.log_metrics(values, step)
    return time.perf_counter() - t0


def _keep_up_with_ingest(w) -> None:
    """Wait until at most 200 logged steps are still queued for the writer's ingest thread. This loop
    logs faster than any trainer (and than ingest, ~400k points/s); unthrottled, the queue of its
    unread dicts, not the writer, fills the RAM (324 MB at 1 M steps with the store down for 100k).
    The wait is outside the timed call."""
    while w._q.qsize() > 200:
        time.sleep(0.002)


def child_run(args) -> dict:
    from rldiag.collectors.writer import MetricWriter

    store = NullStore()
    spill = Path(args.spill)
    _reset_peak_rss()
    base = _rss_mb("VmRSS")
    w = MetricWriter("bench-run", store, spill_dir=spill, backoff_s=(0.05, 0.5))
    calls, peak_bytes, peak_queue = array("d"), 0, 0
    down_at = int(args.steps * 0.9)
    for step in range(args.steps):
        if step == down_at:
            if not w.flush(3600):
                raise SystemExit("the null store did not take the first 90%")
            store.down = True
        elif step < down_at and step % 500 == 499:
            w.flush(3600)  # the store keeps up, as it does at a training step's pace (this loop is faster)
        elif step % 500 == 499:
            _keep_up_with_ingest(w)
        calls.append(_timed_log(w, step))
        if step % 200 == 0:
            peak_bytes = max(peak_bytes, _dir_bytes(spill))
            peak_queue = max(peak_queue, w._q.qsize())
    while not w._q.empty():  # the last steps reach the journal
        time.sleep(0.1)
        peak_bytes = max(peak_bytes, _dir_bytes(spill))
    time.sleep(1.0)
    peak_bytes = max(peak_bytes, _dir_bytes(spill))
    rss = _rss_mb()  # before the summary's sort copies the samples
    out = {"steps": args.steps, "points": args.steps * len(KEYS), "delivered": store.points,
           "journal_peak_bytes": peak_bytes, "journal_end_bytes": _dir_bytes(spill), "peak_queue_steps": peak_queue,
           "rss_start_mb": base, "rss_peak_mb": rss, "log_call": summarize_ms(calls)}
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


def _line_bytes(step: int) -> float:
    """Journal bytes one point of `step` takes: its `[key,value,timestamp,step],` in a batch line."""
    ts = int(time.time() * 1000)
    return sum(len(json.dumps([k, v, ts, step], separators=(",", ":"))) + 1 for k, v in _values(step).items()) / len(KEYS)


def child_outage(args) -> dict:
    from rldiag.collectors.writer import MetricWriter

    n = args.steps
    store = NullStore(n)
    spill = Path(args.spill)
    _reset_peak_rss()
    base = _rss_mb("VmRSS")
    w = MetricWriter("bench-run", store, spill_dir=spill, backoff_s=(0.05, 0.5))
    down_at, up_at = int(n * 0.4), int(n * 0.6)
    per_step = args.outage_s / max(1, up_at - down_at)
    calls = array("d")
    peak = {"journal_peak_bytes": 0, "backlog_at_journal_peak": 0, "peak_backlog": 0, "journal_excess_max_bytes": 0}
    series: list[list[float]] = []  # [s since start, step, backlog points, journal bytes, RSS MB], every 5 s
    t_start = next_series = time.monotonic()
    t_down = t_up = t_drained = 0.0
    drained_step = -1
    for step in range(n):
        if step == down_at:
            if not w.flush(3600):
                raise SystemExit("the null store did not take the steps before the outage")
            store.down, t_down = True, time.monotonic()
        elif step == up_at:
            store.down, t_up = False, time.monotonic()
        if down_at <= step < up_at:  # the outage: these steps spread over --outage-s seconds
            slot = t_down + (step - down_at) * per_step
            now = time.monotonic()
            if slot > now:
                time.sleep(slot - now)
        elif step % 500 == 499:
            if step < down_at or drained_step >= 0:
                w.flush(3600)  # the store's pace, as before the outage
            elif w.stats.enqueued - w.stats.delivered <= 50_000:
                drained_step, t_drained = step, time.monotonic()  # the backlog is gone (one flush's worth left)
            else:  # draining: a trainer slower than ingest, not waiting for the store
                _keep_up_with_ingest(w)
        calls.append(_timed_log(w, step))
        if step % 200 == 0:
            size, backlog = _dir_bytes(spill), w.stats.enqueued - w.stats.delivered
            excess = size - backlog * _line_bytes(step)  # bytes on disk beyond the backlog's own lines
            peak["journal_excess_max_bytes"] = max(peak["journal_excess_max_bytes"], int(excess))
            peak["peak_backlog"] = max(peak["peak_backlog"], backlog)
            if size > peak["journal_peak_bytes"]:
                peak["journal_peak_bytes"], peak["backlog_at_journal_peak"] = size, backlog
            now = time.monotonic()
            if now >= next_series:
                series.append([round(now - t_start, 1), step, backlog, size, round(_rss_mb("VmRSS"), 1)])
                next_series = now + 5.0
    flushed = w.flush(3600)
    t_end = time.monotonic()
    rss = _rss_mb()  # before the summaries' sorts copy the samples
    stats = w.close(timeout=60)
    print(f"invariant: {stats.ledger()}", flush=True)  # logged = stored + journaled + lost, balance 0
    out = {"steps": n, "points": n * len(KEYS), "outage_steps": up_at - down_at, "outage_s": t_up - t_down,
           "stored": store.points, "distinct": store.distinct(), "duplicated": store.duplicated,
           "flushed": flushed, "undelivered": stats.undelivered, "lost": stats.lost, "refused": stats.refused,
           "balance": stats.balance(), "ledger": stats.ledger(),
           "spilled": stats.spilled, "send_failures": stats.send_failures,
           "drained_s": (t_drained - t_up) if drained_step >= 0 else None, "drained_step": drained_step,
           "seconds": t_end - t_start, **peak, "journal_end_bytes": _dir_bytes(spill),
           "rss_start_mb": base, "rss_peak_mb": rss, "log_call": summarize_ms(calls),
           "log_call_outage": summarize_ms(calls[down_at:up_at]),
           "log_call_after": summarize_ms(calls[up_at:]), "series": series}
    print(json.dumps(out), flush=True)
    return out


def _child(which: str, version: str, args, spill: Path, code_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "bench.journal_scale", "--child", which, "--version", version,
           "--steps", str(args.steps), "--spill", str(spill), "--code", str(code_dir),
           "--outage-s", str(args.outage_s or 0)]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"bench.journal_scale child {which}/{version} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])


def _us(summary: dict) -> str:
    return (f"{summary['median_ms'] * 1e3:.1f} us / {summary['p99_ms'] * 1e3:.1f} us / "
            f"{summary['max_ms']:.2f} ms")


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def summary_rows(runs: dict) -> list[dict]:
    """The README rows of every kind of run on record (compare, after, outage)."""
    rows = []
    cmp_ = runs.get("compare")
    if cmp_:
        b, a, s = cmp_["before"], cmp_["after"], cmp_["steps"]
        ratio_rss = (b["restart"]["rss_peak_mb"] - b["restart"]["rss_start_mb"]) / max(
            1e-3, a["restart"]["rss_peak_mb"] - a["restart"]["rss_start_mb"])
        rows += [
            summary_row(f"journal on disk, {s} steps x 50 metrics (peak)", _mb(a["run"]["journal_peak_bytes"]),
                        f"{_mb(b['run']['journal_peak_bytes'])} (before, one file kept)",
                        f"{b['run']['journal_peak_bytes'] / max(1, a['run']['journal_peak_bytes']):.1f}x smaller",
                        "undelivered + one segment",
                        a["run"]["journal_peak_bytes"] <= a["run"]["journal_end_bytes"] + SEGMENT + 1e5),
            summary_row("restart replay of that journal (RSS growth, time)",
                        f"{a['restart']['rss_peak_mb'] - a['restart']['rss_start_mb']:.0f} MB, {a['restart']['seconds']:.1f} s",
                        f"{b['restart']['rss_peak_mb'] - b['restart']['rss_start_mb']:.0f} MB, {b['restart']['seconds']:.1f} s",
                        f"{ratio_rss:.1f}x less RAM, {b['restart']['seconds'] / max(1e-6, a['restart']['seconds']):.1f}x faster",
                        "streams only undelivered", a["restart"]["replayed"] == b["restart"]["replayed"]),
        ]
    one = runs.get("after")
    if one:
        r, rs, s = one["run"], one["restart"], one["steps"]
        alt = "before: not run at this size (see the compare rows)"
        if cmp_:
            bb = cmp_["before"]["run"]
            alt = (f"before: not run at this size; it keeps every point ({_mb(bb['journal_peak_bytes'])} at "
                   f"{cmp_['steps']} steps)")
        rows += [
            summary_row(f"journal on disk, {s} steps x 50 metrics, today's only (peak; the last 10% undelivered)",
                        f"{_mb(r['journal_peak_bytes'])} ({_mb(r['journal_end_bytes'])} undelivered at the end)", alt,
                        "-", "undelivered + one segment", r["journal_peak_bytes"] <= r["journal_end_bytes"] + SEGMENT + 1e5),
            summary_row(f"writer over {s} steps: peak RSS; log call median / p99 / max",
                        f"{r['rss_peak_mb']:.0f} MB; {_us(r['log_call'])}",
                        f"before, {cmp_['steps']} steps: {cmp_['before']['run']['rss_peak_mb']:.0f} MB; "
                        f"{_us(cmp_['before']['run']['log_call'])}" if cmp_ else "-",
                        "-", "RSS < 200 MB; log call unchanged", r["rss_peak_mb"] < 200),
            summary_row(f"restart replay at {s} steps (RSS growth, time)",
                        f"{rs['rss_peak_mb'] - rs['rss_start_mb']:.0f} MB, {rs['seconds']:.1f} s "
                        f"({rs['replayed']:,} points)", alt.split(";")[0], "-", "streams only undelivered",
                        rs["replayed"] == r["points"] - r["delivered"]),
        ]
    out = runs.get("outage")
    if out:
        down = f"{out['outage_s'] / 60:.0f} min" if out["outage_s"] >= 120 else f"{out['outage_s']:.0f} s"
        what = f"{out['steps']} steps x 50 metrics, {down} outage mid-run"
        rows += [
            summary_row(f"{what}: delivered of logged", f"{out['distinct']:,} of {out['points']:,}, "
                        f"{out['duplicated']} duplicated", "-", "-", "all, once",
                        out["distinct"] == out["points"] and out["duplicated"] == 0),
            summary_row(f"{what}: journal peak, writer peak RSS, log call median / p99 / max",
                        f"{_mb(out['journal_peak_bytes'])} at a backlog of {out['backlog_at_journal_peak']:,} points; "
                        f"{out['rss_peak_mb']:.0f} MB; {_us(out['log_call'])}", "-", "-",
                        "journal <= backlog + one segment; RSS < 200 MB",
                        out["journal_excess_max_bytes"] <= SEGMENT + ENVELOPE * out["journal_peak_bytes"]
                        and out["rss_peak_mb"] < 200),
        ]
    return rows


def _load_runs() -> dict:
    """The runs on record; a file from before kinds of runs holds one compare run."""
    path = RESULTS / "journal_scale.json"
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if "runs" in old:
        return old["runs"]
    if "before" in old and "after" in old:
        return {"compare": {k: old[k] for k in ("env", "quick", "steps", "before_commit", "before", "after")
                            if k in old}}
    return {}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20_000, help="training steps of 50 metrics (default 20000)")
    ap.add_argument("--quick", action="store_true", help="2000 steps (with --outage-s: the outage is 10 s)")
    ap.add_argument("--only-after", action="store_true", help="today's write path alone (no before side)")
    ap.add_argument("--outage-s", type=float, default=0.0,
                    help="the outage run: store down this many seconds mid-run (today's write path)")
    ap.add_argument("--child", choices=("run", "restart", "outage"), help=argparse.SUPPRESS)
    ap.add_argument("--version", choices=("before", "after"), default="after", help=argparse.SUPPRESS)
    ap.add_argument("--spill", help=argparse.SUPPRESS)
    ap.add_argument("--code", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.outage_s < 0:
        ap.error(f"--outage-s {args.outage_s:g}: use a number of seconds > 0 (600 for the issue's 10 minutes)")
    if args.child:
        if args.version == "before":
            _load_before(Path(args.code))
        {"run": child_run, "restart": child_restart, "outage": child_outage}[args.child](args)
        return 0
    if args.quick:
        args.steps = 2000
        args.outage_s = min(args.outage_s, 10.0) if args.outage_s else 0.0
    kind = "outage" if args.outage_s else "after" if args.only_after else "compare"
    entry: dict = {"env": env_info(), "quick": args.quick, "steps": args.steps, "metrics_per_step": len(KEYS)}
    with tempfile.TemporaryDirectory(prefix="rldiag-journal-scale-") as tmp:
        code = Path(tmp) / "before"
        code.mkdir()
        if kind == "outage":
            print(f"outage: {args.steps} steps x {len(KEYS)} metrics, {args.outage_s:g} s down mid-run ...", flush=True)
            entry.update(_child("outage", "after", args, Path(tmp) / "spill", code))
            o = entry
            print(f"  {o['distinct']:,} of {o['points']:,} stored ({o['duplicated']} duplicated); journal peak "
                  f"{_mb(o['journal_peak_bytes'])} at a backlog of {o['backlog_at_journal_peak']:,}; writer RSS "
                  f"{o['rss_peak_mb']:.0f} MB; log call {_us(o['log_call'])}; drained {o['drained_s']} s after", flush=True)
            print(f"  invariant: {o['ledger']}", flush=True)  # logged = stored + journaled + lost; balance 0
        else:
            versions = ("after",) if kind == "after" else ("before", "after")
            if "before" in versions:
                entry["before_commit"] = BEFORE
                for name in ("journal", "writer"):
                    src = subprocess.run(["git", "show", f"{BEFORE}:collectors/{name}.py"], cwd=REPO,
                                         capture_output=True, text=True, check=True).stdout
                    (code / f"{name}.py").write_text(src)
            for version in versions:
                spill = Path(tmp) / f"spill-{version}"
                print(f"{version}: {args.steps} steps x {len(KEYS)} metrics ...", flush=True)
                run = _child("run", version, args, spill, code)
                restart = _child("restart", version, args, spill, code)
                entry[version] = {"run": run, "restart": restart}
                print(f"  journal peak {_mb(run['journal_peak_bytes'])}, writer RSS {run['rss_peak_mb']:.0f} MB, "
                      f"log call {_us(run['log_call'])}; restart {restart['seconds']:.2f} s, RSS "
                      f"{restart['rss_peak_mb']:.0f} MB ({restart['replayed']} points replayed)", flush=True)
            if kind == "after":
                entry.update(entry.pop("after"))
    runs = _load_runs()
    runs[kind] = entry
    results = {"env": entry["env"], "quick": args.quick, "runs": runs, "summary": summary_rows(runs)}
    path = write_result("journal_scale", results)
    print(f"wrote {path}")
    for row in results["summary"]:
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
