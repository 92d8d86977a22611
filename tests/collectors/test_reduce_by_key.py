"""Under torch.distributed the step's values are reduced by key, on two real gloo processes: ranks that pass
the same keys in another order get each key's own mean (before: positional, `a` = (100 + 1) / 2 = 50.5 where
every rank had 100), and ranks whose key sets differ all raise one clear error naming the keys, with no hang."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from mlflow import MlflowClient

from tests.helpers.gloo_job import teardown
from tests.helpers.net import free_port


def _worker(rank: int, world: int, port: int, uri: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from rldiag.collectors import Monitor
    from rldiag.collectors.distributed import KeyMismatchError

    os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    error = None
    with Monitor("by-key", run_name="gloo", tracking_uri=uri, spill_dir=os.path.join(out_dir, f"spill{rank}")) as mon:
        model(torch.ones(2, 3)).sum().backward()
        # every rank has a = 100 and b = 1, in another order on rank 1
        metrics = {"a": torch.tensor(100.0), "b": torch.tensor(1.0)}
        mon.step(0, model, metrics=metrics if rank == 0 else dict(reversed(list(metrics.items()))))
        extra = {"c": 5.0} if rank == 1 else {}  # rank 1 alone logs c
        try:
            mon.step(1, model, metrics={**metrics, **extra})
        except KeyMismatchError as e:
            error = str(e)
        mon.step(2, model, metrics=metrics)  # the ranks are still in step after the error
        run_id = mon.run_id
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"run_id": run_id, "error": error}))
    teardown()


@pytest.mark.timeout(180)
def test_values_are_reduced_by_key_and_a_key_mismatch_is_one_clear_error(tmp_path, sqlite_uri):
    MlflowClient(sqlite_uri).search_experiments()  # migrate before two processes race to
    mp.start_processes(_worker, args=(2, free_port(), sqlite_uri, str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    for r in (r0, r1):  # both ranks raised, with the same message
        assert r["error"] == ("rldiag: the ranks logged different metric keys at step 1: rank 0 lacks ['c']. Every "
                              "rank must pass the same keys to Monitor.step (log a rank-only value with Monitor.log "
                              "on rank 0, or pass it on every rank)")
    client = MlflowClient(sqlite_uri)
    hist = {k: {m.step: m.value for m in client.get_metric_history(r0["run_id"], k)} for k in ("a", "b", "c")}
    # a and b are rank means by key: (100 + 100) / 2 and (1 + 1) / 2; nothing at the mismatched step
    assert hist == {"a": {0: 100.0, 2: 100.0}, "b": {0: 1.0, 2: 1.0}, "c": {}}
