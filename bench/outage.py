"""A tracking-server outage mid-run: rldiag's writer vs MLflow's async logging, side by side.

    python -m bench.outage [--quick]                 # 60 s outage (BENCH_OUTAGE_S or --outage-s)
    BENCH_OUTAGE_S=10 python -m bench.outage         # a quick try

One real `mlflow server --workers 1` over a SQLite file. Two child processes, one after the other
(each has the single-worker server to itself), log 16 metrics per step at `--rate` steps/s, paced by
the clock:
- rldiag: `MetricWriter(run_id, make_sender(uri))`, at the end `close(timeout=--close-timeout)`;
- mlflow: `mlflow.log_metrics(..., synchronous=False)` with `MLFLOW_HTTP_REQUEST_MAX_RETRIES=1` (tuned
  for not blocking), at the end `mlflow.flush_async_logging()`.
After `--pre-s` seconds the server's process group is SIGKILLed; `--outage-s` later it is started again
on the same port and DB (its start-up time adds to the outage); `--post-s` after it answers, the
child stops, drains and exits. Points are then counted in the server's SQLite file: lost = expected
(key, step) pairs missing, duplicated = rows beyond one per (key, step). The stall is the longest
single logging call on the training thread; lateness is how far a step started after its slot.

A third child, the control, runs the same loop through the same outage with no logging at all: each
"call" spins for rldiag's median call time. Whatever stalls it (other processes, the hypervisor taking
this VM's vCPU: /proc/stat counts steal time here) is the floor under the logging variants' stalls.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench  # noqa: F401 - sets MLFLOW_DISABLE_TELEMETRY
from bench._common import (
    METRIC_KEYS,
    count_points,
    env_info,
    missing_steps,
    quiet_mlflow,
    spin_call,
    step_metrics,
    summarize_ms,
    summary_row,
    write_result,
)
from bench._server import MlflowServer

NAME = "outage"
VARIANTS = ("rldiag", "mlflow", "control")
# control: the same loop and outage with no logging at all; each "call" spins for as long as rldiag's
# median call took. Its longest call is what the machine (other processes, the hypervisor taking the
# vCPU) does to any piece of work that long: the floor under every variant's stall.


# ---- child: one training loop ----------------------------------------------------------------
def child(kind: str, uri: str, run_id: str, folder: Path, rate: float, close_timeout: float,
          cpu: int | None = None, spin_us: float = 50.0) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})  # before the writer's threads start: they inherit it
    quiet_mlflow()
    stop, go = folder / "stop", folder / "go"
    if kind == "rldiag":
        from rldiag.collectors.mlflow_store import make_sender
        from rldiag.collectors.writer import MetricWriter

        writer = MetricWriter(run_id, make_sender(uri), tracking_uri=uri, spill_dir=folder / "spill",
                              close_timeout_s=close_timeout)
        log = writer.log_metrics
    elif kind == "control":
        log = spin_call(spin_us)
    else:
        import mlflow

        mlflow.set_tracking_uri(uri)
        mlflow.start_run(run_id=run_id)
        log = lambda m, s: mlflow.log_metrics(m, step=s, synchronous=False)  # noqa: E731
    (folder / "ready").touch()
    while not go.exists():
        time.sleep(0.01)
    rng = random.Random(7)
    gc_pauses = _record_gc()
    durations: list[float] = []
    lateness: list[float] = []
    worst, worst_at = -1.0, 0.0
    stamps: list[float] = []
    gc_in_call: list[float] = []
    t0 = time.monotonic()
    step = 0
    while not stop.exists():
        slot = t0 + step / rate
        now = time.monotonic()
        if now < slot:
            time.sleep(slot - now)
        lateness.append(max(0.0, time.monotonic() - slot))
        m = step_metrics(step, rng)
        t = time.perf_counter()
        log(m, step)
        d = time.perf_counter() - t
        if gc_pauses and gc_pauses[-1][0] >= t:  # a collection ran inside this call
            gc_in_call.append(d)
        if d > worst:
            worst, worst_at = d, time.monotonic() - t0
        durations.append(d)
        stamps.append(time.monotonic() - t0)
        step += 1
    t_loop = time.monotonic() - t0
    res: dict = {"kind": kind, "steps": step, "loop_s": t_loop,
                 "expected_points": 0 if kind == "control" else step * len(METRIC_KEYS),
                 "log_call": summarize_ms(durations), "worst_stall_at_s": worst_at,
                 "lateness": summarize_ms(lateness), "error": None,
                 "log_call_at_s": stamps, "log_call_ms": [x * 1e3 for x in durations],
                 "gc": {"collections": len(gc_pauses), "max_ms": max((p[1] for p in gc_pauses), default=0.0) * 1e3,
                        "gen2": sum(p[2] == 2 for p in gc_pauses),
                        "log_calls_with_gc": len(gc_in_call),
                        "longest_log_call_with_gc_ms": max(gc_in_call, default=0.0) * 1e3}}
    t = time.perf_counter()
    try:
        if kind == "rldiag":
            st = writer.close(timeout=close_timeout)
            res["writer_stats"] = {"delivered": st.delivered, "undelivered": st.undelivered,
                                   "send_failures": st.send_failures, "last_error": st.last_error,
                                   "journaled": st.journaled, "lost": st.lost, "balance": st.balance(),
                                   "ledger": st.ledger()}
            print(f"[rldiag] invariant: {st.ledger()}", flush=True)  # logged = stored + journaled + lost
            res["journal_left"] = (folder / "spill" / f"{run_id}.jsonl").exists()
        elif kind == "mlflow":
            mlflow.flush_async_logging()
    except Exception as e:  # noqa: BLE001 - record what the user would see
        res["error"] = f"{type(e).__name__}: {e}"[:500]
    res["drain_s"] = time.perf_counter() - t
    if kind == "mlflow":
        try:
            mlflow.end_run()
        except Exception as e:  # noqa: BLE001
            res["end_run_error"] = f"{type(e).__name__}: {e}"[:300]
    (folder / "result.json").write_text(json.dumps(res))


def _record_gc() -> list[tuple[float, float, int]]:
    """(start, seconds, generation) of every garbage collection in this process, from now on: a full
    collection of a big heap can stall whichever thread triggered it, rldiag or not."""
    import gc

    pauses: list[tuple[float, float, int]] = []
    started = [0.0]

    def cb(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append((started[0], time.perf_counter() - started[0], info["generation"]))

    gc.callbacks.append(cb)
    return pauses


# ---- parent: server, outage, counting -------------------------------------------------------
def _wait_for(path: Path, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            log_text = (path.parent / "child.log").read_text(errors="replace")
            raise RuntimeError(f"child exited early with {proc.returncode}:\n{log_text[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"child not ready within {timeout}s")
        time.sleep(0.1)


def _by_phase(at_s: list[float], ms: list[float], kill_at: float, up_at: float) -> dict:
    """Longest log call and p99 before the kill, while the server is down, and after it is back."""
    phases = {"before": [], "outage": [], "after": []}
    for t, d in zip(at_s, ms):
        phases["before" if t < kill_at else "outage" if t < up_at else "after"].append(d)
    return {k: {"n": len(v), "max_ms": max(v, default=0.0), "p99_ms": sorted(v)[int(0.99 * (len(v) - 1))] if v else 0.0}
            for k, v in phases.items()}


def _one_variant(v: str, server: MlflowServer, exp: str, folder: Path, repo: Path, args) -> dict:
    """Run one child through pre-phase, SIGKILL, outage, restart, post-phase; count what the server holds."""
    from mlflow.tracking import MlflowClient

    run_id = MlflowClient(server.uri).create_run(exp, run_name=f"outage-{v}").info.run_id
    folder.mkdir()
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    if v == "mlflow":
        env["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "1"
    cmd = [sys.executable, "-m", "bench.outage", "--child", v, "--uri", server.uri, "--run-id", run_id,
           "--dir", str(folder), "--rate", str(args.rate), "--close-timeout", str(args.close_timeout)]
    if args.pin:
        cmd += ["--cpu", "1"]
    if v == "control":
        cmd += ["--spin-us", f"{args.spin_us:.1f}"]
    with open(folder / "child.log", "wb") as logf:
        proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=logf, stderr=subprocess.STDOUT)
    try:
        _wait_for(folder / "ready", 180, proc)
        (folder / "go").touch()
        t_go = time.monotonic()
        print(f"[{v}] logging at {args.rate:g} steps/s; server kill in {args.pre_s:g} s", flush=True)
        time.sleep(args.pre_s)
        t_kill = time.monotonic()
        server.kill()
        print(f"[{v}] server SIGKILLed; restarting in {args.outage_s:g} s", flush=True)
        time.sleep(args.outage_s)
        restart_s = server.start()
        t_up = time.monotonic()
        print(f"[{v}] server answers again after {t_up - t_kill:.1f} s down (start-up {restart_s:.1f} s)", flush=True)
        time.sleep(args.post_s)
        (folder / "stop").touch()
        t_stop = time.monotonic()
        proc.wait(args.close_timeout + 180)
        t_done = time.monotonic()
    finally:
        if proc.poll() is None:
            proc.kill()
    log_text = (folder / "child.log").read_text(errors="replace")
    path = folder / "result.json"
    if not path.exists():
        raise RuntimeError(f"{v} child wrote no result; its log ends:\n{log_text[-3000:]}")
    r = json.loads(path.read_text())
    back = count_points(server.db, run_id)
    r["read_back"] = back
    r["lost"] = r["expected_points"] - back["distinct_key_step"]
    r["duplicated"] = back["rows"] - back["distinct_key_step"]
    r["missing_step_ranges"] = missing_steps(server.db, run_id, r["steps"])
    r["child_log_error_lines"] = sum(1 for line in log_text.splitlines() if "ERROR" in line)
    r["child_log_tail"] = log_text[-1500:]
    r["child_log_first_errors"] = [line[:300] for line in log_text.splitlines() if "ERROR" in line][:5]
    r["log_call_by_phase"] = _by_phase(r.pop("log_call_at_s"), r.pop("log_call_ms"), t_kill - t_go, t_up - t_go)
    r["timeline"] = {"kill_at_s": t_kill - t_go, "down_s": t_up - t_kill, "restart_startup_s": restart_s,
                     "up_at_s": t_up - t_go, "stop_at_s": t_stop - t_go, "child_done_after_stop_s": t_done - t_stop}
    print(f"[{v}] {r['lost']} of {r['expected_points']} points lost, {r['duplicated']} duplicated; "
          f"missing steps {r['missing_step_ranges'][:5]}", flush=True)
    if "ledger" in (r.get("writer_stats") or {}):  # the writer's own count: logged = stored + journaled + lost
        print(f"[{v}] invariant: {r['writer_stats']['ledger']}", flush=True)
    return r


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="10 s outage, short phases")
    ap.add_argument("--outage-s", type=float, default=float(os.environ.get("BENCH_OUTAGE_S", "60")))
    ap.add_argument("--pre-s", type=float, default=10.0, help="logging before the kill")
    ap.add_argument("--post-s", type=float, default=40.0,
                    help="logging after the server answers again (long enough to cover the backlog's drain)")
    ap.add_argument("--rate", type=float, default=20.0, help="steps per second")
    ap.add_argument("--close-timeout", type=float, default=300.0, help="rldiag close(timeout=)")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                    help="server on CPU 0, the training process on CPU 1, as if the server ran on another "
                         "machine (default; --no-pin lets them share both cores)")
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--cpu", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--spin-us", type=float, default=50.0, help=argparse.SUPPRESS)
    ap.add_argument("--uri", help=argparse.SUPPRESS)
    ap.add_argument("--run-id", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, args.uri, args.run_id, Path(args.dir), args.rate, args.close_timeout, args.cpu,
              args.spin_us)
        return {}
    if args.quick:
        args.outage_s = min(args.outage_s, 10.0)
        args.pre_s, args.post_s = 5.0, 5.0
    quiet_mlflow()
    from mlflow.tracking import MlflowClient

    repo = Path(__file__).resolve().parent.parent
    if args.pin:
        if len(os.sched_getaffinity(0)) < 2:
            ap.error("--pin needs 2 CPUs; use --no-pin")
        os.sched_setaffinity(0, {0})  # this process and the server it starts; the child moves to CPU 1
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="rldiag-bench-") as d:
        work = Path(d)
        (work / "server").mkdir()
        server = MlflowServer(work / "server")
        first_start_s = server.start()
        try:
            exp = MlflowClient(server.uri).create_experiment("bench-outage")
            for v in VARIANTS:  # one after the other: each has the single-worker server to itself
                if v == "control":  # as long as rldiag's typical call
                    args.spin_us = results["rldiag"]["log_call"]["median_ms"] * 1e3
                results[v] = _one_variant(v, server, exp, work / v, repo, args)
        finally:
            server.kill()
    out = {"benchmark": NAME, "quick": args.quick, "env": env_info(), "rate_steps_per_s": args.rate, "metrics_per_step": len(METRIC_KEYS),
           "outage_s": args.outage_s, "pinned": args.pin, "pre_s": args.pre_s, "post_s": args.post_s,
           "first_server_start_s": first_start_s, **results}
    print(f"\n{'variant':<8}{'down s':>7}{'steps':>7}{'expected':>10}{'stored':>8}{'lost':>7}{'dup':>5}"
          f"{'stall ms':>10}{'p99 ms':>8}{'drain s':>9}  error")
    for v in VARIANTS:
        r = results[v]
        print(f"{v:<8}{r['timeline']['down_s']:7.1f}{r['steps']:7d}{r['expected_points']:10d}"
              f"{r['read_back']['distinct_key_step']:8d}{r['lost']:7d}{r['duplicated']:5d}{r['log_call']['max_ms']:10.2f}"
              f"{r['log_call']['p99_ms']:8.3f}{r['drain_s']:9.2f}  {r['error']}; {r['child_log_error_lines']} ERROR log lines")
    rl, ml, ctl = results["rldiag"], results["mlflow"], results["control"]
    print(f"longest training-thread call: rldiag {rl['log_call']['max_ms']:.2f} ms, MLflow {ml['log_call']['max_ms']:.2f} ms; "
          f"no logging at all (control: {args.spin_us:.0f} us of spinning a call) {ctl['log_call']['max_ms']:.2f} ms",
          flush=True)
    out["summary"] = [summary_row(
        f"server outage ({rl['timeline']['down_s']:.0f} s / {ml['timeline']['down_s']:.0f} s down) at {args.rate:g} "
        "steps/s: points lost / duplicated",
        f"{rl['lost']} lost, {rl['duplicated']} dup of {rl['expected_points']}; max stall {rl['log_call']['max_ms']:.1f} ms",
        f"MLflow async (1 retry): {ml['lost']} lost, {ml['duplicated']} dup; max stall {ml['log_call']['max_ms']:.1f} ms",
        f"{ml['lost']} vs {rl['lost']} lost",
        "0 lost, 0 duplicated",
        rl["lost"] == 0 and rl["duplicated"] == 0,
    ), summary_row(
        "server outage: longest training-thread log call (pinned: server on CPU 0, training on CPU 1)",
        f"{rl['log_call']['max_ms']:.2f} ms (p99 {rl['log_call']['p99_ms']:.2f})",
        f"no logging, same loop and outage (control, {args.spin_us:.0f} us calls): {ctl['log_call']['max_ms']:.2f} ms; "
        f"MLflow async: {ml['log_call']['max_ms']:.2f} ms",
        f"{rl['log_call']['max_ms'] / max(ctl['log_call']['max_ms'], 1e-9):.2f}x control",
        "< 1 ms",
        rl["log_call"]["max_ms"] < 1.0,
    )]
    print(f"wrote {write_result(NAME, out)}")
    return out


if __name__ == "__main__":
    main()
