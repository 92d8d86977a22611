"""Runs written the way rldiag writes them (open_run + MetricWriter), or as a foreign trainer writes
them (MLflow's own batch call, transformers' MLflowCallback in a fresh interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

from rldiag.collectors.mlflow_store import make_sender, open_run
from rldiag.collectors.writer import MetricWriter

T0_MS = 1_700_000_000_000


def write_run(
    uri: str,
    *,
    experiment: str = "exp",
    name: str = "run",
    tags: Mapping[str, str] | None = None,
    params: Mapping[str, object] | None = None,
    steps: Iterable[tuple[int, Mapping[str, float]]] = (),
    run_id: str | None = None,
    finish: bool = True,
    t0_ms: int = T0_MS,
) -> str:
    """Open (or resume) a run and log `(step, {key: value})` through rldiag's writer; returns the run id.

    Timestamps are `t0_ms + step`, so a resumed run that logs a step again can pass a later `t0_ms`.
    """
    client, run = open_run(uri, experiment=experiment, run_name=name, run_id=run_id, tags=tags, params=params)
    rid = run.info.run_id
    writer = MetricWriter(rid, make_sender(uri), tracking_uri=uri, spill_dir=None)
    for step, metrics in steps:
        writer.log_metrics(metrics, step, timestamp_ms=t0_ms + step)
    stats = writer.close(timeout=120)
    assert stats.undelivered == 0 and stats.rejected == 0, stats
    if finish:
        client.set_terminated(rid)
    return rid


def log_raw(uri: str, run_id: str, points: Iterable[tuple[str, float, int, int]]) -> None:
    """`(key, value, timestamp_ms, step)` through MLflow's own batch call, as a foreign trainer writes."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    ms = [Metric(k, v, ts, st) for k, v, ts, st in points]
    client = MlflowClient(uri)
    for i in range(0, len(ms), 1000):
        client.log_batch(run_id, metrics=ms[i : i + 1000])


def run_logging_script(script: str, uri: str, experiment: str, cwd: Path):
    """Run `script` (a real trainer logging through transformers' `report_to="mlflow"`) in a fresh
    interpreter in `cwd`, into experiment `experiment` of `uri`; returns the JSON it printed after "LOGS="."""
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "MLFLOW_EXPERIMENT_NAME": experiment,
           "MLFLOW_DISABLE_TELEMETRY": "true", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.split("LOGS=", 1)[1].splitlines()[0])
