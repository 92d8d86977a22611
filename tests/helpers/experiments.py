"""The masked-vs-unmasked experiment run for real into a SQLite store in a temp folder (`run_mvu`): the tests
that read its runs (its own, the report's glance, one verdict) share how it is set up."""

from __future__ import annotations

from pathlib import Path

import pytest


def run_mvu(tmp: Path, steps: int, experiment: str, configs=None) -> tuple[str, list]:
    """`masked_vs_unmasked.run_experiment` of `steps` steps into `tmp`/mlruns.db (the cwd there, so journals and
    artifacts land in it; $MLFLOW_TRACKING_URI unset); `configs`: (batch, accumulation) pairs, None for the
    experiment's own. Returns the store's URI and the runs' summaries."""
    from rldiag.experiments import masked_vs_unmasked as mvu

    uri = f"sqlite:///{tmp / 'mlruns.db'}"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp)
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        extra = {} if configs is None else {"configs": configs}
        cfg = mvu.ExperimentConfig(base=mvu.DistillConfig(steps=steps), experiment=experiment, **extra)
        return uri, mvu.run_experiment(cfg, tracking_uri=uri, progress=False)
