"""Runs written by the trackers' own writers (torch's SummaryWriter, wandb offline in a fresh interpreter),
and what an import left in the store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest


def write_tensorboard(logdir: Path, steps: Iterable[tuple[int, Mapping[str, float]]], *,
                      hparams: Mapping[str, object] | None = None, new_style: bool = False) -> Path:
    """Log `(step, {tag: value})` with torch's SummaryWriter into `logdir`; returns its event file."""
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(log_dir=str(logdir))
    for step, scalars in steps:
        for tag, v in scalars.items():
            w.add_scalar(tag, v, step, new_style=new_style)
    if hparams:
        w.add_hparams(dict(hparams), {"hparam/final": 0.0}, run_name=".")
    w.close()
    files = sorted(logdir.glob("events.out.tfevents.*"))
    return files[0]


WANDB_SCRIPT = """
import json, math, sys, wandb
spec = json.loads(sys.argv[1])
run = wandb.init(project=spec["project"], config=spec["config"], dir=spec["dir"], name=spec.get("name"))
sm = spec.get("step_metric")
if sm:  # as transformers' WandbCallback logs: every metric against sm, W&B's own _step only counts rows
    run.define_metric(sm)
    run.define_metric("*", step_metric=sm, step_sync=True)
for step, row in spec["steps"]:
    if sm:
        run.log({**{k: float(v) for k, v in row.items()}, sm: step})
    else:
        run.log({k: float(v) for k, v in row.items()}, step=step)
run.finish(exit_code=spec.get("exit_code", 0))
print("FILE=" + run.settings.sync_file)
"""


def write_wandb(root: Path, steps: Iterable[tuple[int, Mapping[str, float]]], *, project: str = "proj",
                config: Mapping[str, object] | None = None, exit_code: int = 0, name: str | None = None,
                step_metric: str | None = None) -> Path:
    """Log `(step, {key: value})` with wandb offline (a fresh interpreter) under `root`; returns its .wandb file.
    `step_metric`: the step goes into the row under that name, every metric defined against it (W&B's
    `define_metric`, as transformers' WandbCallback does with train/global_step), instead of `log(step=)`.
    Non-finite values travel as the strings 'nan', 'inf', '-inf' and are turned back by float()."""
    pytest.importorskip("wandb", reason="the [import] extra (wandb) is not installed")
    spec = {"project": project, "config": dict(config or {}), "dir": str(root), "exit_code": exit_code, "name": name,
            "step_metric": step_metric,
            "steps": [[s, {k: repr(float(v)) for k, v in row.items()}] for s, row in steps]}
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true",
           "WANDB_DISABLE_CODE": "true"}
    out = subprocess.run([sys.executable, "-c", WANDB_SCRIPT, json.dumps(spec)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return Path(out.stdout.split("FILE=", 1)[1].splitlines()[0])


def metric_rows(uri: str) -> int:
    """The store's metric rows (every point and inf flag), counted with sqlite3."""
    import sqlite3

    with sqlite3.connect(uri.removeprefix("sqlite:///")) as con:
        return con.execute("SELECT COUNT(*) FROM metrics").fetchone()[0]


def imported_runs(uri: str):
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    exps = [e.experiment_id for e in client.search_experiments()]
    return client.search_runs(exps, filter_string="tags.`rldiag.import.source` != ''") if exps else []
