"""Two short stock-TRL runs (GRPOTrainer, `report_to="mlflow"`): 8 steps each, as transformers'
MLflowCallback logs them (TRL's own names, one `log_batch` a step, no rldiag tags), the candidate with a
NaN `grad_norm` from step NAN_FROM on and TRL's `kl` and `entropy` rows stopping after step LAST_KL.
(What the report and the dashboard show of them: tests/app/test_short_nan_runs.py, tests/app/dashboard/test_pages.py.)
"""

from __future__ import annotations

import math

from rldiag.app.analysis.divergence import DivergenceConfig
from tests.helpers.runs import T0_MS, log_raw

STEPS = range(1, 9)  # transformers' global_step: 1 after the first optimizer step
NAN_FROM = 4  # grad_norm NaN from here on
LAST_KL = 4  # TRL logs kl and entropy up to here
NEEDED = DivergenceConfig().min_steps


def _logs(step: int, *, nan: bool) -> dict[str, float]:
    """One step's `trainer.state.log_history` entry of a GRPOTrainer, numbers only (what MLflowCallback keeps)."""
    m = {"loss": 0.02 + 0.001 * step, "grad_norm": 0.5 + 0.05 * step, "learning_rate": 1e-6 * (1 - step / 10),
         "num_tokens": 64.0 * step, "completions/mean_length": 4.0, "completions/clipped_ratio": 1.0,
         "rewards/reward_len/mean": 10.0 + 0.1 * step, "rewards/reward_len/std": 1.0,
         "reward": 10.0 + 0.1 * step, "reward_std": 1.0 + 0.01 * step, "frac_reward_zero_std": 0.0,
         "kl": 0.001 * step, "entropy": 2.5 - 0.01 * step, "clip_ratio/low_mean": 0.0, "clip_ratio/high_mean": 0.0,
         "clip_ratio/region_mean": 0.001 * (step % 3), "epoch": step / 8}
    if nan and step >= NAN_FROM:
        m["grad_norm"] = math.nan
    if nan and step > LAST_KL:
        del m["kl"], m["entropy"]
    return m


def write_trl_runs(uri: str, experiment: str = "trl-short") -> tuple[str, str]:
    """(reference id, candidate id): the two runs of the module docstring, the reference created first."""
    from mlflow import MlflowClient
    from mlflow.entities import Param

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    exp_id = exp.experiment_id if exp else client.create_experiment(experiment)
    ids = []
    for i, (name, nan) in enumerate((("grpo-ok", False), ("grpo-nan", True))):
        rid = client.create_run(exp_id, start_time=T0_MS + 1000 * i, run_name=name).info.run_id
        client.log_batch(rid, params=[Param(k, v) for k, v in {"learning_rate": "1e-06", "max_steps": "8",
                                                               "beta": "0.1"}.items()])
        for s in STEPS:  # MLflowCallback.on_log: one log_metrics call a step, at step=state.global_step
            log_raw(uri, rid, [(k, v, T0_MS + 1000 * i + s, s) for k, v in _logs(s, nan=nan).items()])
        client.set_terminated(rid)
        ids.append(rid)
    return ids[0], ids[1]
