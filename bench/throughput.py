"""Sustained points/s into SQLite: rldiag's writer vs raw `MlflowClient.log_batch` of 1000 metrics a call.

    python -m bench.throughput [--quick] [--points N] [--rounds R]

rldiag: enqueue N points (16 a step, a fresh dict per step) as fast as the caller can, then `close()`;
timed from the first enqueue until `close()` returns, i.e. until the store holds every point. Raw:
the same points, built into `Metric` entities and sent 1000 per `log_batch` call. Every round uses a
fresh store (a copy of one migrated file) and the variants alternate, so drift hits them alike. The
points are counted back from the SQLite file. A third variant, rldiag without its journal
(`spill_dir=None`), shows what the journal costs.
"""

from __future__ import annotations

import argparse
import random
import statistics
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
    summary_row,
    write_result,
)

NAME = "throughput"
GOAL = 0.9  # rldiag >= 0.9x the points/s of raw log_batch


def _new_run(uri: str, name: str) -> str:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.create_experiment(f"bench-throughput-{time.time_ns()}")
    return client.create_run(exp, run_name=name).info.run_id


def run_rldiag(uri: str, db: Path, steps: int, spill: Path | None) -> dict:
    from rldiag.collectors.mlflow_store import make_sender
    from rldiag.collectors.writer import MetricWriter

    run_id = _new_run(uri, "rldiag")
    rng = random.Random(0)
    payloads = [step_metrics(s, rng) for s in range(steps)]
    writer = MetricWriter(run_id, make_sender(uri), tracking_uri=uri, spill_dir=spill)
    t0 = time.perf_counter()
    for s, m in enumerate(payloads):
        writer.log_metrics(m, s)
    t_enq = time.perf_counter() - t0
    stats = writer.close(timeout=600)
    total = time.perf_counter() - t0
    n = steps * len(METRIC_KEYS)
    back = count_points(db, run_id)
    return {"points": n, "seconds": total, "enqueue_s": t_enq, "points_per_s": n / total, "read_back": back,
            "complete": back["distinct_key_step"] == n and back["rows"] == n,
            "undelivered": stats.undelivered, "send_failures": stats.send_failures}


def run_raw(uri: str, db: Path, steps: int) -> dict:
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    run_id = _new_run(uri, "raw-log-batch")
    client = MlflowClient(uri)
    rng = random.Random(0)
    payloads = [step_metrics(s, rng) for s in range(steps)]
    t0 = time.perf_counter()
    batch: list = []
    for s, m in enumerate(payloads):
        ts = int(time.time() * 1000)
        batch.extend(Metric(k, v, ts, s) for k, v in m.items())
        if len(batch) >= 1000:
            client.log_batch(run_id, metrics=batch[:1000])
            batch = batch[1000:]
    if batch:
        client.log_batch(run_id, metrics=batch)
    total = time.perf_counter() - t0
    n = steps * len(METRIC_KEYS)
    back = count_points(db, run_id)
    return {"points": n, "seconds": total, "points_per_s": n / total, "read_back": back,
            "complete": back["distinct_key_step"] == n and back["rows"] == n}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="20k points, one round")
    ap.add_argument("--points", type=int, default=100_000, help="points per variant per round")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    args = ap.parse_args(argv)
    if args.quick:
        args.points, args.rounds = 20_000, 1
    quiet_mlflow()
    steps = args.points // len(METRIC_KEYS)
    rounds: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="rldiag-bench-") as d:
        work = Path(d)
        for r in range(args.rounds):
            res = {}
            order = ["rldiag", "raw", "rldiag_no_journal"] if r % 2 == 0 else ["raw", "rldiag_no_journal", "rldiag"]
            for variant in order:
                db = work / f"r{r}-{variant}.db"
                uri = fresh_sqlite_db(db)
                if variant == "raw":
                    res[variant] = run_raw(uri, db, steps)
                else:
                    spill = work / f"spill-{r}" if variant == "rldiag" else None
                    res[variant] = run_rldiag(uri, db, steps, spill)
                print(f"  round {r} {variant:<18} {res[variant]['points_per_s']:8.0f} points/s "
                      f"({res[variant]['seconds']:.1f} s, complete={res[variant]['complete']})", flush=True)
            rounds.append(res)
    med = {v: statistics.median(x[v]["points_per_s"] for x in rounds) for v in rounds[0]}
    ratio = med["rldiag"] / med["raw"]
    ratio_per_round = [x["rldiag"]["points_per_s"] / x["raw"]["points_per_s"] for x in rounds]
    complete = all(x[v]["complete"] for x in rounds for v in x)
    out = {
        "benchmark": NAME, "quick": args.quick, "env": env_info(), "points_per_variant": steps * len(METRIC_KEYS), "rounds": rounds,
        "median_points_per_s": med, "ratio_rldiag_over_raw": ratio, "ratio_per_round": ratio_per_round,
        "ratio_no_journal_over_raw": med["rldiag_no_journal"] / med["raw"], "all_complete": complete,
    }
    print(f"\nmedian points/s: rldiag {med['rldiag']:.0f}, raw log_batch {med['raw']:.0f}, "
          f"rldiag without journal {med['rldiag_no_journal']:.0f}; rldiag/raw = {ratio:.2f}x "
          f"(per round {', '.join(f'{q:.2f}' for q in ratio_per_round)})")
    out["summary"] = [summary_row(
        "sustained points/s into SQLite",
        f"{med['rldiag']:.0f}/s",
        f"raw log_batch x1000: {med['raw']:.0f}/s",
        f"{ratio:.2f}x",
        f">= {GOAL}x",
        ratio >= GOAL and complete,
    )]
    print(f"wrote {write_result(NAME, out)}")
    return out


if __name__ == "__main__":
    main()
