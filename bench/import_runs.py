"""`rldiag import tensorboard` against TensorBoard's own reader: 10 runs x 50 scalars x 10k steps (5 M points).

    python -m bench.import_runs [--runs 10] [--scalars 50] [--steps 10000] [--quick] [--read-only]

The runs are written once by torch's SummaryWriter (cached under /tmp/rldiag-bench) and then read:
- TensorBoard: `EventAccumulator(run, size_guidance={"scalars": 0})`, `Reload()`, `Scalars(tag)` for
  every tag (every point in memory; what TensorBoard itself does, without its server);
- rldiag's reader alone (app/importers/tensorboard.py: every scalar parsed, nothing written);
- `rldiag import` end to end into a fresh SQLite store (read, send through rldiag's writer, stored by
  MLflow), checked by counting the store's rows; then the same import again (nothing new to add);
- the floor: MLflow's own `log_batch`, 1000 points a call, of the first run's points into another fresh
  store (what any importer into MLflow pays), as points per second beside the import's.
Ratios are against the EventAccumulator read. `--quick`: 2 runs x 10 scalars x 500 steps. `--read-only`: the
two reads alone, no store written (the import is bound by MLflow's writes: about 2,000 points/s on 2 shared
cores: 5 M points took 30 minutes on 2026-12-07).
"""

from __future__ import annotations

import argparse
import math
import sqlite3
import tempfile
import time
from pathlib import Path

import bench  # noqa: F401 - sets MLFLOW_DISABLE_TELEMETRY
from bench._common import env_info, fresh_sqlite_db, quiet_mlflow, summary_row, write_result

NAME = "import_runs"
CACHE = Path(tempfile.gettempdir()) / "rldiag-bench"


def write_logdir(runs: int, scalars: int, steps: int) -> Path:
    """`runs` folders of `scalars` tags x `steps` steps, written by SummaryWriter; one NaN per run."""
    from torch.utils.tensorboard import SummaryWriter

    root = CACHE / f"import_tb_{runs}x{scalars}x{steps}"
    done = root / ".complete"
    if done.exists():
        return root
    for r in range(runs):
        w = SummaryWriter(str(root / f"run{r:02d}"), max_queue=1000, flush_secs=3600)
        for s in range(steps):
            for k in range(scalars):
                w.add_scalar(f"metrics/m{k:02d}", math.nan if (s, k) == (steps // 2, 0) else r + k + s * 1e-4, s)
        w.close()
    done.touch()
    return root


def read_event_accumulator(root: Path) -> int:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    n = 0
    for run in sorted(p for p in root.iterdir() if p.is_dir()):
        ea = EventAccumulator(str(run), size_guidance={"scalars": 0})
        ea.Reload()
        n += sum(len(ea.Scalars(t)) for t in ea.Tags()["scalars"])
    return n


def read_rldiag(root: Path) -> int:
    from rldiag.app.importers.tensorboard import find_runs

    return sum(len(r.poll(final=True).points) for r in find_runs(root))


def import_rldiag(root: Path, uri: str) -> tuple[int, list[str]]:
    from rldiag.app.importers.loop import import_path

    said: list[str] = []
    status = import_path("tensorboard", str(root), uri, tags_for=lambda name: {}, say=said.append)
    return status, said


def log_batch_floor(root: Path, uri: str) -> int:
    """The first run's points through `MlflowClient.log_batch`, 1000 a call (values read beforehand)."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    from rldiag.app.importers.tensorboard import find_runs

    points = find_runs(root)[0].poll(final=True).points
    metrics = [Metric(k, v, ts, s) for k, s, ts, v in points]
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("floor")).info.run_id
    t = time.perf_counter()
    for i in range(0, len(metrics), 1000):
        client.log_batch(run_id, metrics=metrics[i:i + 1000])
    return len(metrics) / (time.perf_counter() - t)


def timed(fn, *args):
    t = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t, out


def read_only_result(a, total: int, t_ea: float, n_ea: int, t_read: float, n_read: int) -> dict:
    """The two reads' result (`--read-only`): written as import_runs_read[_quick].json."""
    ok = n_ea == n_read == total
    result = {
        "config": {"runs": a.runs, "scalars": a.scalars, "steps": a.steps, "points": total, "quick": a.quick,
                   "read_only": True},
        "env": env_info(),
        "event_accumulator_s": t_ea, "rldiag_reader_s": t_read, "reader_ratio": t_read / t_ea,
        "points_read": n_read, "all_points_read": ok,
        "summary": [summary_row(
            f"read {a.runs}x{a.scalars}x{a.steps} TensorBoard points", f"rldiag's reader {t_read:.1f} s",
            f"EventAccumulator read {t_ea:.1f} s", f"{t_read / t_ea:.2f}x", "every point read", ok)],
    }
    path = write_result(NAME + "_read" + ("_quick" if a.quick else ""), result)
    print(f"{'OK' if ok else 'MISMATCH'}: wrote {path}")
    return result


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--scalars", type=int, default=50)
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--quick", action="store_true", help="2 runs x 10 scalars x 500 steps")
    p.add_argument("--read-only", action="store_true", help="EventAccumulator against rldiag's reader; no import")
    a = p.parse_args(argv)
    if a.quick:
        a.runs, a.scalars, a.steps = 2, 10, 500
    quiet_mlflow()
    total = a.runs * a.scalars * a.steps
    t_write, root = timed(write_logdir, a.runs, a.scalars, a.steps)
    print(f"{a.runs} runs x {a.scalars} scalars x {a.steps} steps = {total:,} points in {root} "
          f"(written by SummaryWriter in {t_write:.1f} s, or cached)", flush=True)
    t_ea, n_ea = timed(read_event_accumulator, root)
    print(f"TensorBoard EventAccumulator: {n_ea:,} points in {t_ea:.1f} s", flush=True)
    t_read, n_read = timed(read_rldiag, root)
    print(f"rldiag's reader alone: {n_read:,} points in {t_read:.1f} s ({t_read / t_ea:.2f}x)", flush=True)
    if a.read_only:
        return read_only_result(a, total, t_ea, n_ea, t_read, n_read)
    work = Path(tempfile.mkdtemp(prefix="rldiag-bench-import-"))
    uri = fresh_sqlite_db(work / "mlruns.db")
    t_imp, (status, said) = timed(import_rldiag, root, uri)
    with sqlite3.connect(work / "mlruns.db") as con:
        rows, nans = con.execute("SELECT COUNT(*), SUM(is_nan) FROM metrics").fetchone()
    print(f"rldiag import into SQLite: {rows:,} rows ({nans} NaN) in {t_imp:.1f} s ({t_imp / t_ea:.2f}x the "
          f"EventAccumulator read; {rows / t_imp:,.0f} points/s); status {status}", flush=True)
    t_again, (status2, said2) = timed(import_rldiag, root, uri)
    with sqlite3.connect(work / "mlruns.db") as con:
        rows2 = con.execute("SELECT COUNT(*) FROM metrics").fetchone()[0]
    print(f"import again: {rows2 - rows} rows added in {t_again:.1f} s", flush=True)
    floor = log_batch_floor(root, fresh_sqlite_db(work / "floor.db"))
    print(f"MLflow log_batch alone (the floor): {floor:,.0f} points/s; the import reaches "
          f"{rows / t_imp / floor:.0%} of it", flush=True)
    ok = n_ea == n_read == rows == rows2 == total and nans == a.runs and status == status2 == 0
    result = {
        "config": {"runs": a.runs, "scalars": a.scalars, "steps": a.steps, "points": total, "quick": a.quick},
        "env": env_info(),
        "event_accumulator_s": t_ea, "rldiag_reader_s": t_read, "rldiag_import_s": t_imp, "reimport_s": t_again,
        "reader_ratio": t_read / t_ea, "import_ratio": t_imp / t_ea, "import_points_per_s": rows / t_imp,
        "log_batch_points_per_s": floor, "import_share_of_log_batch": rows / t_imp / floor,
        "rows": rows, "rows_after_reimport": rows2, "nan_rows": nans, "all_points_stored": ok,
        "import_lines": said[:3] + said2[:3],
        "summary": [summary_row(
            f"import {a.runs}x{a.scalars}x{a.steps} TensorBoard points", f"{t_imp:.1f} s (reader alone {t_read:.1f} s)",
            f"EventAccumulator read {t_ea:.1f} s", f"{t_imp / t_ea:.1f}x", "every point stored, re-import adds 0",
            ok)],
    }
    path = write_result(NAME + ("_quick" if a.quick else ""), result)
    print(f"{'OK' if ok else 'MISMATCH'}: wrote {path}")
    return result


if __name__ == "__main__":
    main()
