"""Two real processes on gloo: NaN on one rank only; every rank agrees, none deadlocks, rank 0 writes."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from mlflow import MlflowClient

from tests.helpers.gloo_job import teardown
from tests.helpers.net import free_port

NAN_STEP = 2


def _worker(rank: int, world: int, port: int, uri: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from rldiag.collectors import Monitor
    from tests.helpers.gloo_job import gloo_step

    os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)  # same weights on both ranks
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    results = []
    with Monitor("dist", run_name="gloo", tracking_uri=uri, policy="skip", per_rank=True,
                 spill_dir=os.path.join(out_dir, f"spill{rank}")) as mon:
        for step in range(4):
            loss, stats = gloo_step(model, rank, step, nan_step=NAN_STEP)
            go = mon.step(step, model, loss=loss, metrics=stats)
            results.append({"step": step, "go": go, "finite": mon.last_report.finite,
                            "names": mon.last_report.nonfinite_params})
            model.zero_grad()
        run_id = mon.run_id
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"results": results, "run_id": run_id}))
    teardown()


@pytest.mark.timeout(300)
def test_nan_on_one_rank(tmp_path, sqlite_uri):
    mp.start_processes(_worker, args=(2, free_port(), sqlite_uri, str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    for r in (r0, r1):  # both ranks agree: skip at NAN_STEP only
        assert [x["go"] for x in r["results"]] == [s != NAN_STEP for s in range(4)]
        assert r["results"][NAN_STEP]["names"] == ["rank1:1.bias"]
    assert r1["run_id"] is None  # only rank 0 opens a run and writes

    client = MlflowClient(sqlite_uri)
    run_id = r0["run_id"]
    hist = lambda k: {m.step: m.value for m in client.get_metric_history(run_id, k)}  # noqa: E731
    assert hist("grad/finite") == {0: 1.0, 1: 1.0, 2: 0.0, 3: 1.0}
    # Token-level clip rate over all ranks: (1 + 1) / (3 + 1) = 0.5, not the mean of 1/3 and 1.
    assert hist("policy/clip_rate")[0] == pytest.approx(0.5)
    assert hist("batch/valid_tokens")[0] == 4.0
    # Rewards pooled over ranks: [1, 3, 5] -> mean 3, sample std 2.
    assert hist("reward/mean")[0] == pytest.approx(3.0)
    assert hist("reward/std")[0] == pytest.approx(2.0)
    # Minima and maxima over ranks, not their mean: token ratios e^0.5, 1, 1 (rank 0) and e^0.5 (rank 1) -> min
    # 1.0; sequence ratios exp(0.5 / 3) = 1.18136 (rank 0) and e^0.5 = 1.64872 (rank 1)
    assert hist("policy/ratio_min")[0] == pytest.approx(1.0)
    assert hist("policy/ratio_min_seq")[0] == pytest.approx(math.exp(0.5 / 3), rel=1e-6)
    assert hist("policy/ratio_max_seq")[0] == pytest.approx(math.exp(0.5), rel=1e-6)
    # Per-rank values on request.
    assert hist("rank0/policy/clip_rate")[0] == pytest.approx(1 / 3)
    assert hist("rank1/policy/clip_rate")[0] == pytest.approx(1.0)
    tags = client.get_run(run_id).data.tags
    assert tags["rldiag.alert.first_step"] == str(NAN_STEP) and "rank1:1.bias" in tags["rldiag.alert.last"]
