"""One engine-parity store for the whole session: every variant of experiments/engine_parity.py run
with a real vLLM engine into a SQLite file, read back once (tags, params, full metric histories).

The parity tests, the likely-causes tests and the divergence-onset tests read the same runs: vLLM
engines start in 20-60 s each here, so the six engine configurations start once per session.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.helpers.parity import PARITY_SEEDS, PARITY_STEPS, ParityStore, StoredRun


@pytest.fixture(scope="session")
def parity_store(tmp_path_factory: pytest.TempPathFactory) -> ParityStore:
    """Every engine-parity variant, PARITY_SEEDS reference seeds, PARITY_STEPS steps, in a fresh SQLite store."""
    pytest.importorskip("vllm")
    from mlflow import MlflowClient

    from rldiag.collectors import keys
    from rldiag.experiments.engine_parity import VARIANTS, ParityConfig, run_experiment

    tmp: Path = tmp_path_factory.mktemp("parity")
    uri = f"sqlite:///{tmp / 'mlruns.db'}"
    cfg = ParityConfig(steps=PARITY_STEPS, seeds=PARITY_SEEDS, variants=tuple(VARIANTS))
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp)  # journals and artifacts land in tmp
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        t0 = time.monotonic()
        summaries = run_experiment(cfg, tracking_uri=uri, progress=False, model_dir=tmp / "model")
        wall = time.monotonic() - t0
    assert [s.undelivered for s in summaries] == [0] * len(summaries)

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(cfg.experiment)
    runs: dict[tuple[str, int], StoredRun] = {}
    for run in client.search_runs([exp.experiment_id], max_results=100):
        metrics = {}
        for key in run.data.metrics:
            history = sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)
            metrics[key] = [m.value for m in history]
        tags = run.data.tags
        runs[(tags[keys.TAG_VARIANT], int(tags[keys.TAG_SEED]))] = StoredRun(run.info.run_id, tags, run.data.params,
                                                                              metrics)
    return ParityStore(uri, wall, runs)
