"""Training-thread time per step to log 16 metrics: rldiag's writer vs MLflow's sync and async logging.

    python -m bench.write_latency [--quick]

On a SQLite file store and on a local `mlflow server --workers 1`, each path logs a fresh dict of 16
floats per step, with a short pause between steps (`--gap-ms`, a stand-in for the step's compute that
lets background threads run, as they would during a real step). Only the logging call is timed;
after the loop everything is flushed/closed (drain time reported apart) and the points are counted
back from the store's SQLite file. MLflow's async path sends one request per logged step (no
`MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS`), so at a 2 ms gap it falls behind and its drain is long.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import bench  # noqa: F401 - sets MLFLOW_DISABLE_TELEMETRY
from bench._common import (
    METRIC_KEYS,
    count_points,
    env_info,
    fresh_sqlite_db,
    quiet_mlflow,
    step_metrics,
    summarize_ms,
    summary_row,
    write_result,
)
from bench._server import MlflowServer

NAME = "write_latency"
WARMUP = 10  # first steps of each path are logged but not counted in the statistics
GOAL_MEDIAN_MS = 0.05
GOAL_VS_ASYNC = 5.0


def _timed_loop(log, steps: int, gap_s: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    out = []
    for step in range(steps):
        m = step_metrics(step, rng)
        t0 = time.perf_counter()
        log(m, step)
        out.append(time.perf_counter() - t0)
        if gap_s:
            time.sleep(gap_s)
    return out[WARMUP:]


def bench_store(label: str, uri: str, db: Path, work: Path, *, sync_steps: int, async_steps: int, gap_s: float) -> dict:
    import mlflow
    from mlflow.tracking import MlflowClient

    from rldiag.collectors.mlflow_store import make_sender
    from rldiag.collectors.writer import MetricWriter

    client = MlflowClient(uri)
    exp = client.create_experiment(f"bench-write-latency-{label}-{time.time_ns()}")
    mlflow.set_tracking_uri(uri)
    res: dict = {"store": label, "uri": uri}

    with mlflow.start_run(experiment_id=exp, run_name="mlflow-sync") as run:
        t = _timed_loop(lambda m, s: mlflow.log_metrics(m, step=s), sync_steps, gap_s, 1)
    res["mlflow_sync"] = {**summarize_ms(t), "steps": sync_steps, "drain_s": 0.0,
                          "read_back": count_points(db, run.info.run_id)}

    with mlflow.start_run(experiment_id=exp, run_name="mlflow-async") as run:
        t = _timed_loop(lambda m, s: mlflow.log_metrics(m, step=s, synchronous=False), async_steps, gap_s, 2)
        t0 = time.perf_counter()
        mlflow.flush_async_logging()
        drain = time.perf_counter() - t0
    res["mlflow_async"] = {**summarize_ms(t), "steps": async_steps, "drain_s": drain,
                           "read_back": count_points(db, run.info.run_id)}

    run = client.create_run(exp, run_name="rldiag")
    writer = MetricWriter(run.info.run_id, make_sender(uri), tracking_uri=uri, spill_dir=work / f"spill-{label}")
    t = _timed_loop(writer.log_metrics, async_steps, gap_s, 3)
    t0 = time.perf_counter()
    stats = writer.close(timeout=300)
    drain = time.perf_counter() - t0
    client.set_terminated(run.info.run_id)
    res["rldiag"] = {**summarize_ms(t), "steps": async_steps, "drain_s": drain,
                     "read_back": count_points(db, run.info.run_id),
                     "writer_stats": {"delivered": stats.delivered, "undelivered": stats.undelivered,
                                      "send_failures": stats.send_failures}}

    r, a, s = res["rldiag"], res["mlflow_async"], res["mlflow_sync"]
    res["ratios"] = {
        "async_over_rldiag_median": a["median_ms"] / r["median_ms"],
        "async_over_rldiag_p99": a["p99_ms"] / r["p99_ms"],
        "sync_over_rldiag_median": s["median_ms"] / r["median_ms"],
    }
    for name in ("mlflow_sync", "mlflow_async", "rldiag"):
        v = res[name]
        v["expected_points"] = v["steps"] * len(METRIC_KEYS)
        v["complete"] = v["read_back"]["distinct_key_step"] == v["expected_points"]
    return res


def _print(res: dict) -> None:
    print(f"\n[{res['store']}] training-thread ms per step (16 metrics)")
    print(f"  {'path':<14}{'median':>9}{'p99':>9}{'max':>9}{'steps':>7}{'drain s':>9}  read back")
    for name in ("rldiag", "mlflow_async", "mlflow_sync"):
        v = res[name]
        print(f"  {name:<14}{v['median_ms']:9.4f}{v['p99_ms']:9.3f}{v['max_ms']:9.2f}{v['steps']:7d}"
              f"{v['drain_s']:9.2f}  {v['read_back']['distinct_key_step']}/{v['expected_points']}")
    q = res["ratios"]
    print(f"  async/rldiag: median {q['async_over_rldiag_median']:.1f}x, p99 {q['async_over_rldiag_p99']:.1f}x; "
          f"sync/rldiag median {q['sync_over_rldiag_median']:.0f}x")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps")
    ap.add_argument("--gap-ms", type=float, default=2.0, help="pause between steps (the step's compute)")
    args = ap.parse_args(argv)
    quiet_mlflow()
    sqlite_sync, sqlite_async = (100, 1000) if args.quick else (300, 3000)
    rest_sync, rest_async = (50, 500) if args.quick else (150, 1500)
    gap = args.gap_ms / 1e3
    out: dict = {"benchmark": NAME, "quick": args.quick, "env": env_info(), "gap_ms": args.gap_ms, "metrics_per_step": len(METRIC_KEYS),
                 "warmup_steps_excluded": WARMUP}
    with tempfile.TemporaryDirectory(prefix="rldiag-bench-") as d:
        work = Path(d)
        db = work / "store.db"
        uri = fresh_sqlite_db(db)
        out["sqlite"] = bench_store("sqlite", uri, db, work, sync_steps=sqlite_sync, async_steps=sqlite_async, gap_s=gap)
        _print(out["sqlite"])
        srv_root = work / "server"
        srv_root.mkdir()
        with MlflowServer(srv_root) as server:
            out["server"] = bench_store("server", server.uri, server.db, work, sync_steps=rest_sync,
                                        async_steps=rest_async, gap_s=gap)
        _print(out["server"])
    rows = []
    for store in ("sqlite", "server"):
        r = out[store]
        med, ratio = r["rldiag"]["median_ms"], r["ratios"]["async_over_rldiag_median"]
        rows.append(summary_row(
            f"log 16 metrics, training-thread ms/step ({store})",
            f"{med:.4f} ms (p99 {r['rldiag']['p99_ms']:.3f})",
            f"MLflow async {r['mlflow_async']['median_ms']:.3f} ms (p99 {r['mlflow_async']['p99_ms']:.2f}); "
            f"sync {r['mlflow_sync']['median_ms']:.1f} ms",
            f"{ratio:.1f}x faster than async",
            f"<= {GOAL_MEDIAN_MS} ms and >= {GOAL_VS_ASYNC:.0f}x",
            med <= GOAL_MEDIAN_MS and ratio >= GOAL_VS_ASYNC and r["rldiag"]["complete"],
        ))
    out["summary"] = rows
    print(f"\nwrote {write_result(NAME, out)}")
    return out


if __name__ == "__main__":
    main()
