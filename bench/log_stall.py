"""How often the training thread's log call stalls while the tracking server is down, against the same
loop with no logging at all: is a stall rldiag's, or the machine's?

    python -m bench.log_stall [--rate 200] [--rounds 6] [--round-s 30] [--cpu 1] [--quick]

Each round runs two child processes one after the other, both pinned to one CPU (`--cpu`) and paced
by the clock at `--rate` calls per second:
- rldiag: `MetricWriter.log_metrics` of 16 metrics a step, its sender posting to a port where nothing
  listens (the server is down: every send fails and is retried with back-off, the backlog grows and is
  journalled), so its background threads work on the same core as the training thread;
- control: no logging at all; each "call" spins for as long as rldiag's median call.
A call's stall is its wall time. The rounds alternate, so slow spells of the machine (other processes,
the hypervisor taking this VM's vCPU: /proc/stat counts steal time here) fall on both. Reported per
variant: calls, longest, p99.9, and calls over 0.5 ms and over 1 ms per 10,000 calls. rldiag is
counted as stalling no more than the control when its count of calls over 1 ms exceeds the control's
by at most two standard deviations of that difference (counts of rare events: sqrt of their sum).
bench.outage measures the same call through a real server's kill and restart, at 20 steps/s.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench  # noqa: F401 - sets MLFLOW_DISABLE_TELEMETRY
from bench._common import env_info, spin_call, summary_row, write_result

NAME = "log_stall"
KEYS = [f"policy/k{i:02d}" for i in range(16)]


def child(kind: str, rate: float, seconds: float, spin_us: float, folder: Path, out: Path) -> None:
    calls: list[float] = []
    if kind == "rldiag":
        logging.disable(logging.CRITICAL)  # the "store unreachable" warning
        from rldiag.collectors.mlflow_store import make_sender
        from rldiag.collectors.writer import MetricWriter

        with socket.socket() as s:  # a free port that nothing listens on: every send is refused
            s.bind(("127.0.0.1", 0))
            uri = f"http://127.0.0.1:{s.getsockname()[1]}"
        writer = MetricWriter("0" * 32, make_sender(uri), tracking_uri=uri, spill_dir=folder,
                              backoff_s=(0.05, 0.2))
        log = writer.log_metrics
    else:
        log = spin_call(spin_us)
    t0, step = time.monotonic(), 0
    while time.monotonic() - t0 < seconds:
        slot = t0 + step / rate
        now = time.monotonic()
        if now < slot:
            time.sleep(slot - now)
        m = {k: step * 1e-3 + i for i, k in enumerate(KEYS)}
        t = time.perf_counter()
        log(m, step)
        calls.append((time.perf_counter() - t) * 1e3)
        step += 1
    res = {"calls_ms": calls}
    if kind == "rldiag":
        res["send_failures"] = writer.stats.send_failures
        res["enqueued_points"] = writer.stats.enqueued
    out.write_text(json.dumps(res))
    os._exit(0)  # the writer would otherwise keep retrying at exit; its journal is a temp folder


def _stats(ms: list[float]) -> dict:
    xs = sorted(ms)
    n = len(xs)
    return {"calls": n, "median_ms": xs[n // 2], "p999_ms": xs[min(n - 1, int(0.999 * n))], "max_ms": xs[-1],
            "over_0_5ms_per_10k": sum(x > 0.5 for x in xs) * 1e4 / n, "over_1ms_per_10k": sum(x > 1 for x in xs) * 1e4 / n,
            "over_1ms": sum(x > 1 for x in xs)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=200.0, help="log calls per second")
    ap.add_argument("--rounds", type=int, default=6, help="rounds of rldiag then control")
    ap.add_argument("--round-s", type=float, default=30.0, help="seconds each child logs in a round")
    ap.add_argument("--cpu", type=int, default=1, help="the CPU both children are pinned to")
    ap.add_argument("--quick", action="store_true", help="2 rounds of 10 s")
    ap.add_argument("--child", choices=("rldiag", "control"), help=argparse.SUPPRESS)
    ap.add_argument("--spin-us", type=float, default=50.0, help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, args.rate, args.round_s, args.spin_us, Path(args.dir), Path(args.out))
        return {}
    if args.quick:
        args.rounds, args.round_s = 2, 10.0
    if args.cpu not in os.sched_getaffinity(0):
        ap.error(f"--cpu {args.cpu}: this process may run on CPUs {sorted(os.sched_getaffinity(0))} only")
    repo = Path(__file__).resolve().parent.parent
    calls: dict[str, list[float]] = {"rldiag": [], "control": []}
    extra: dict = {}
    spin_us = 50.0
    with tempfile.TemporaryDirectory(prefix="rldiag-stall-") as d:
        for r in range(args.rounds):
            for kind in ("rldiag", "control"):
                out = Path(d) / f"{kind}-{r}.json"
                cmd = ["taskset", "-c", str(args.cpu), sys.executable, "-m", "bench.log_stall", "--child", kind,
                       "--rate", str(args.rate), "--round-s", str(args.round_s), "--spin-us", f"{spin_us:.1f}",
                       "--dir", str(Path(d) / f"spill-{r}"), "--out", str(out)]
                subprocess.run(cmd, cwd=repo, check=True, timeout=args.round_s + 300)
                res = json.loads(out.read_text())
                calls[kind] += res.pop("calls_ms")
                if kind == "rldiag":
                    spin_us = _stats(calls["rldiag"])["median_ms"] * 1e3  # control spins as long as rldiag's call
                    extra = res
                s = _stats(calls[kind])
                print(f"round {r + 1}/{args.rounds} {kind:<8} calls {s['calls']:6d}  max {s['max_ms']:6.2f} ms  "
                      f">1 ms {s['over_1ms']}", flush=True)
    stats = {k: _stats(v) for k, v in calls.items()}
    rl, ctl = stats["rldiag"], stats["control"]
    print(f"\n{'variant':<8}{'calls':>7}{'median ms':>10}{'p99.9 ms':>9}{'max ms':>8}{'>0.5ms/10k':>11}{'>1ms/10k':>9}")
    for k, s in stats.items():
        print(f"{k:<8}{s['calls']:7d}{s['median_ms']:10.3f}{s['p999_ms']:9.3f}{s['max_ms']:8.2f}"
              f"{s['over_0_5ms_per_10k']:11.1f}{s['over_1ms_per_10k']:9.1f}")
    result = {
        "env": env_info(), "quick": args.quick, "rate": args.rate, "rounds": args.rounds, "round_s": args.round_s, "cpu": args.cpu,
        "control_spin_us": spin_us, **stats, "rldiag_last_round": extra,
        "summary": [summary_row(
            f"server down: training-thread log calls over 1 ms, per 10,000 ({args.rate:g} calls/s, one CPU)",
            f"{rl['over_1ms_per_10k']:.1f} (longest {rl['max_ms']:.2f} ms)",
            f"no logging (control, {spin_us:.0f} us calls): {ctl['over_1ms_per_10k']:.1f} (longest {ctl['max_ms']:.2f} ms)",
            f"{rl['over_1ms_per_10k'] / ctl['over_1ms_per_10k']:.2f}x" if ctl["over_1ms"] else "-",
            "no more than the control",
            rl["over_1ms"] - ctl["over_1ms"] <= 2 * (rl["over_1ms"] + ctl["over_1ms"]) ** 0.5,
        )],
    }
    print(f"results: {write_result(NAME, result)}")
    return result


if __name__ == "__main__":
    main()
