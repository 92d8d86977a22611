"""Shared helpers: timing summaries, metric payloads, SQLite stores and result files."""

from __future__ import annotations

import json
import logging
import platform
import random
import shutil
import sqlite3
import statistics
import time
from pathlib import Path

from rldiag.collectors import keys

RESULTS = Path(__file__).resolve().parent / "results"
# 16 keys, as one training step logs them: real rldiag keys (padded should the canonical set shrink).
METRIC_KEYS: tuple[str, ...] = tuple([*keys.CANONICAL_METRICS, *(f"bench/extra_{i}" for i in range(16))][:16])
_TEMPLATE_DB: Path | None = None


def step_metrics(step: int, rng: random.Random) -> dict[str, float]:
    """A fresh `{key: float}` of `len(METRIC_KEYS)` = 16 values for `step` (a new dict each step, as `Monitor.step` builds)."""
    return {k: rng.random() + step for k in METRIC_KEYS}


def summarize_ms(samples_s: list[float]) -> dict[str, float]:
    """Median, p99, mean and max of durations in seconds, as milliseconds."""
    xs = sorted(samples_s)
    p99 = xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))]
    return {
        "n": len(xs),
        "median_ms": statistics.median(xs) * 1e3,
        "p99_ms": p99 * 1e3,
        "mean_ms": statistics.fmean(xs) * 1e3,
        "max_ms": xs[-1] * 1e3,
    }


def fresh_sqlite_db(path: Path) -> str:
    """A new, migrated MLflow SQLite store at `path`; copies a template so that only the first costs ~8 s."""
    global _TEMPLATE_DB
    from mlflow.tracking import MlflowClient

    if _TEMPLATE_DB is None or not _TEMPLATE_DB.exists():
        template = path.parent / "_template.db"
        MlflowClient(f"sqlite:///{template}").search_experiments()  # runs the schema migrations
        _TEMPLATE_DB = template
    shutil.copyfile(_TEMPLATE_DB, path)
    return f"sqlite:///{path}"


def count_points(db: Path, run_id: str) -> dict[str, int]:
    """Rows and distinct (key, step) pairs of a run, read straight from an MLflow SQLite file."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=60) as con:
        rows, distinct = con.execute(
            "SELECT COUNT(*), COUNT(DISTINCT key || '@' || step) FROM metrics WHERE run_uuid = ?", (run_id,)
        ).fetchone()
    return {"rows": rows, "distinct_key_step": distinct}


def missing_steps(db: Path, run_id: str, steps: int) -> list[list[int]]:
    """Steps in `range(steps)` that lack any of the 16 keys, as `[first, last]` ranges."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=60) as con:
        full = {s for (s,) in con.execute(
            "SELECT step FROM metrics WHERE run_uuid = ? GROUP BY step HAVING COUNT(DISTINCT key) >= ?",
            (run_id, len(METRIC_KEYS)))}
    ranges: list[list[int]] = []
    for s in range(steps):
        if s in full:
            continue
        if ranges and ranges[-1][1] == s - 1:
            ranges[-1][1] = s
        else:
            ranges.append([s, s])
    return ranges


def quiet_mlflow() -> None:
    """MLflow logs INFO lines for every migration and run; keep benchmark output readable."""
    for name in ("mlflow", "alembic", "mlflow.store.db.utils"):
        logging.getLogger(name).setLevel(logging.WARNING)


def env_info() -> dict:
    import mlflow
    import torch

    return {
        "python": platform.python_version(),
        "mlflow": mlflow.__version__,
        "torch": torch.__version__,
        "cpus": __import__("os").cpu_count(),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def spin_call(spin_us: float):
    """A stand-in for a log call that logs nothing: `call(metrics, step)` spins on the clock for
    `spin_us` microseconds and returns. Timed like the real call, its stalls are the machine's own
    (other processes, the hypervisor taking the vCPU), the floor under a logging call's (bench.outage's
    and bench.log_stall's control)."""
    def call(metrics, step, _spin=spin_us * 1e-6, _clock=time.perf_counter) -> None:
        end = _clock() + _spin
        while _clock() < end:
            pass
    return call


def summary_row(benchmark: str, rldiag: str, alternative: str, ratio: str, goal: str, met: bool | None) -> dict:
    """One line of the README table (see run_all.py)."""
    return {"benchmark": benchmark, "rldiag": rldiag, "alternative": alternative, "ratio": ratio, "goal": goal,
            "met": met}


def write_result(name: str, data: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    tmp.replace(path)
    return path


# ---- big stores for the read-side benchmarks --------------------------------------------------
BENCH_T0_MS = 1_700_000_000_000
MAX_FLOAT = 1.7976931348623157e308  # what MLflow's SQL stores keep for +inf


def metric_store(path: Path, experiment: str, runs: list[tuple[str, dict[str, str], dict[str, str]]],
                 metric_keys, steps: int, series) -> tuple[str, list[str]]:
    """An MLflow SQLite store at `path` (reused when it holds `len(runs)` runs): runs made by MLflow
    (schema, experiment, names, tags), metrics filled by direct SQL inserts, as MLflow stores them.

    `runs`: (name, tags, params) per run; `series(run_no, key_no, key)` gives that metric's `steps` values,
    NaN and +-inf included: NaN is stored as value 0 with is_nan 1, +-inf as +-max-float plus rldiag's
    `rldiag/inf/<key>` flag, as the writer logs it. Timestamps are t0 + 100 ms per step; every run
    ends FINISHED. Returns (uri, run ids in `runs` order).
    """
    import numpy as np
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{path}"
    if path.exists():
        with sqlite3.connect(path) as con:
            by_name = dict(con.execute("SELECT name, run_uuid FROM runs"))
        if len(by_name) == len(runs) and all(run[0] in by_name for run in runs):
            return uri, [by_name[run[0]] for run in runs]
        path.unlink()
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    client = MlflowClient(f"sqlite:///{tmp}")
    exp = client.create_experiment(experiment)
    ids = []
    for i, (name, tags, params) in enumerate(runs):
        ids.append(client.create_run(exp, run_name=name, tags=tags, start_time=BENCH_T0_MS + i).info.run_id)
        for k, v in params.items():
            client.log_param(ids[-1], k, v)
    step = np.arange(steps)
    ts = (BENCH_T0_MS + step * 100).tolist()
    with sqlite3.connect(tmp) as con:
        con.execute("PRAGMA journal_mode=OFF")
        con.execute("PRAGMA synchronous=OFF")
        for i, rid in enumerate(ids):
            for k, key in enumerate(metric_keys):
                v = np.asarray(series(i, k, key), np.float64)
                is_nan = np.isnan(v)
                stored = np.where(is_nan, 0.0, np.clip(v, -MAX_FLOAT, MAX_FLOAT))
                con.executemany("INSERT INTO metrics (key, value, timestamp, run_uuid, step, is_nan) VALUES (?,?,?,?,?,?)",
                                zip([key] * steps, stored.tolist(), ts, [rid] * steps, step.tolist(),
                                    is_nan.astype(int).tolist()))
                for s in np.flatnonzero(np.isinf(v)).tolist():
                    con.execute("INSERT INTO metrics VALUES (?,?,?,?,?,?)",
                                (keys.inf_flag_key(key), 1.0 if v[s] > 0 else -1.0, ts[s], rid, s, 0))
        con.execute("""INSERT OR REPLACE INTO latest_metrics (key, value, timestamp, step, is_nan, run_uuid)
                       SELECT key, value, timestamp, step, is_nan, run_uuid FROM metrics m
                       WHERE step = (SELECT MAX(step) FROM metrics WHERE run_uuid = m.run_uuid AND key = m.key)""")
        con.execute("UPDATE runs SET status='FINISHED', end_time=start_time + 1000")
    tmp.replace(path)
    return uri, ids
