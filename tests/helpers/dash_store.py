"""The runs of the dashboard tests' store (the `dash_store` fixture, tests/app/dashboard/conftest.py),
written through rldiag's writer (`write_run`).

Experiment `dash`, group `v0_vs_v1`, 300 steps each, noise with fixed seeds:
- `v0 ref` (reference, seed 0), `v0 seed1`, `v0 seed2` (candidates that differ only in seed),
- `v1 shifted`: policy/ratio_mean and policy/kl_new_old step up at SHIFT_AT (5 noise sd),
- `unmasked`: grad/norm NaN at NAN_STEPS and +inf at INF_STEP (grad/finite 0 there), its last-alert
  tag naming parameters and a token,
- `trl run` (no rldiag tags): only TRL's names grad_norm, kl (read as policy/kl_ref), entropy, reward,
  clip_ratio/region_mean,
- `throughput only` (no tags): keys no canonical metric maps to,
- `<img src=x onerror=alert(1)>`: a run named like an attack, a plain candidate.
Experiment `empty` has no runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from rldiag.collectors import keys
from tests.helpers.runs import write_run

STEPS = 300
SHIFT_AT = 150
NAN_STEPS = (40, 41, 200)
INF_STEP = 250
EVIL = "<img src=x onerror=alert(1)>"
GROUP = "v0_vs_v1"
ENGINE = {"engine.name": "vllm", "engine.logprobs_mode": "processed_logprobs", "engine.enable_prefix_caching": "False",
          "trainer.per_device_batch_size": 4, "trainer.gradient_accumulation_steps": 2, "lr": 1e-6}


def _series(seed: int, shift: float = 0.0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    t = np.arange(STEPS)
    after = (t >= SHIFT_AT) * shift
    return {
        keys.RATIO_MEAN: 1.0 + rng.normal(0, 0.01, STEPS) + 0.05 * after,
        keys.CLIP_RATE: 0.05 + rng.normal(0, 0.005, STEPS),
        keys.KL_NEW_OLD: 0.01 + rng.normal(0, 0.001, STEPS) + 0.005 * after,
        keys.ENTROPY: 2.0 - t / 1000 + rng.normal(0, 0.02, STEPS),
        keys.REWARD_MEAN: 0.2 + t / 1000 + rng.normal(0, 0.02, STEPS),
        keys.GRAD_NORM: 1.0 + rng.normal(0, 0.05, STEPS),
        keys.GRAD_FINITE: np.ones(STEPS),
        keys.LOSS: 0.5 + rng.normal(0, 0.02, STEPS),
    }


def _steps(series: dict[str, np.ndarray]):
    return [(s, {k: float(v[s]) for k, v in series.items()}) for s in range(STEPS)]


@dataclass(frozen=True)
class DashStore:
    uri: str
    ids: dict[str, str]  # run name -> run id


def write_dash_store(uri: str) -> dict[str, str]:
    """Write the runs of the module docstring into the migrated store `uri` (run in the folder the
    artifacts and journals should land in); returns {run name: run id}."""
    ids = {}
    tag = lambda role, variant, seed: {keys.TAG_GROUP: GROUP, keys.TAG_ROLE: role,  # noqa: E731
                                       keys.TAG_VARIANT: variant, keys.TAG_SEED: str(seed)}
    for i, name in enumerate(("v0 ref", "v0 seed1", "v0 seed2")):
        ids[name] = write_run(uri, experiment="dash", name=name, params=ENGINE, steps=_steps(_series(i)),
                              tags=tag("reference" if i == 0 else "candidate", "v0-parity", i))
    v1 = dict(ENGINE, **{"engine.logprobs_mode": "raw_logprobs", "engine.enable_prefix_caching": "True"})
    ids["v1 shifted"] = write_run(uri, experiment="dash", name="v1 shifted", params=v1,
                                  steps=_steps(_series(3, shift=1.0)), tags=tag("candidate", "v1-defaults", 3))
    bad = _series(4)
    for s in NAN_STEPS:
        bad[keys.GRAD_NORM][s], bad[keys.GRAD_FINITE][s] = np.nan, 0.0
    bad[keys.GRAD_NORM][INF_STEP], bad[keys.GRAD_FINITE][INF_STEP] = np.inf, 0.0
    alert = {"step": 200, "params": ["model.embed.weight", "model.lm_head.weight"],
             "positions": [{"sample": 1, "position": 3}]}
    ids["unmasked"] = write_run(uri, experiment="dash", name="unmasked", params=dict(ENGINE, lr=2e-6),
                                steps=_steps(bad), tags={**tag("candidate", "unmasked", 4),
                                                         keys.TAG_ALERT_COUNT: "4", keys.TAG_ALERT_FIRST_STEP: "40",
                                                         keys.TAG_ALERT_LAST: json.dumps(alert)})
    trl = _series(5)
    trl_names = {keys.GRAD_NORM: "grad_norm", keys.KL_NEW_OLD: "kl", keys.ENTROPY: "entropy",
                 keys.REWARD_MEAN: "reward", keys.CLIP_ACTIVE_RATE: "clip_ratio/region_mean"}
    ids["trl run"] = write_run(uri, experiment="dash", name="trl run",
                               steps=_steps({trl_names[k]: v for k, v in trl.items() if k in trl_names}))
    ids["throughput only"] = write_run(uri, experiment="dash", name="throughput only",
                                       steps=[(s, {"tokens_per_sec": 1000.0 + s, "lr": 1e-6}) for s in range(20)])
    ids[EVIL] = write_run(uri, experiment="dash", name=EVIL, params=ENGINE, steps=_steps(_series(6)),
                          tags=tag("candidate", "v0-parity", 6))
    from mlflow import MlflowClient

    MlflowClient(uri).create_experiment("empty")
    return ids
