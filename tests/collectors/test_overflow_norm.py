"""A finite gradient whose float32 norm overflows (elements ~1e30: the squares pass float32's 3.4e38) is a
healthy step: a finite `grad/norm` (taken in float64), `grad/finite` 1, no alert, nothing skipped. Real tiny
models, real backward passes, a real SQLite MLflow store."""

from __future__ import annotations

import math

import mlflow
import pytest
import torch
from torch import nn

from rldiag.collectors import Monitor, check_gradients, keys

BIG = 1e30  # finite in float32 (max 3.4e38); its square is not


def big_grads() -> tuple[nn.Module, float]:
    """A linear layer whose gradients are ~1e30 element by element, and their exact norm (float64)."""
    torch.manual_seed(0)
    net = nn.Linear(4, 3)
    x = torch.randn(5, 4)
    (net(x).sum() * BIG).backward()
    exact = math.sqrt(math.fsum(float(g.double().square().sum()) for g in (net.weight.grad, net.bias.grad)))
    assert all(torch.isfinite(p.grad).all() for p in net.parameters())
    assert not math.isfinite(float(torch.linalg.vector_norm(net.weight.grad)))  # float32 overflows
    return net, exact


def test_check_gradients_gives_the_float64_norm():
    net, exact = big_grads()
    report = check_gradients(net)
    assert report.finite is True and report.nonfinite_params == []
    assert report.norm == pytest.approx(exact, rel=1e-6) and math.isfinite(report.norm)


@pytest.mark.parametrize("policy", ["warn", "skip", "raise"])
def test_monitor_logs_a_finite_norm_and_no_alert(sqlite_uri, tmp_path, policy):
    net, exact = big_grads()
    before = net.weight.grad.clone()
    alerts = tmp_path / "alerts.jsonl"
    with Monitor("overflow", tracking_uri=sqlite_uri, policy=policy, alerts_jsonl=alerts) as mon:
        assert mon.step(0, net, loss=torch.tensor(1.0)) is True
        rid = mon.run_id
    assert torch.equal(net.weight.grad, before)  # nothing zeroed
    client = mlflow.MlflowClient(sqlite_uri)
    got = {k: client.get_metric_history(rid, k) for k in (keys.GRAD_NORM, keys.GRAD_FINITE)}
    assert got[keys.GRAD_NORM][0].value == pytest.approx(exact, rel=1e-6)
    assert got[keys.GRAD_FINITE][0].value == 1.0
    assert client.get_metric_history(rid, keys.GRAD_NONFINITE_PARAMS)[0].value == 0.0
    assert not alerts.exists() or alerts.read_text() == ""
    assert keys.TAG_ALERT_COUNT not in client.get_run(rid).data.tags


def test_a_real_nan_beside_an_overflowing_norm_is_still_named(sqlite_uri):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    (net(torch.randn(5, 4)).sum() * BIG).backward()
    net[1].bias.grad[0] = float("nan")
    report = check_gradients(net)
    assert report.finite is False and report.nonfinite_params == ["1.bias"]


class BigLoss(nn.Module):
    """A model for `Trainer` whose loss is scaled so that its gradients are ~1e30 (finite elements)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, **_) -> dict:
        return {"loss": self.lin(x).sum() * BIG}


def test_trainer_callback_overflow_is_a_finite_step_without_a_made_up_norm(sqlite_uri, tmp_path):
    """transformers' Trainer clips before the callback's hook; torch's clip_grad_norm_ takes the overflowed
    float32 norm (inf) and scales every gradient to 0, so the pre-clip norm is gone: the step is logged finite,
    without `grad/norm` (no number made up), and with no alert."""
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainingArguments

    from rldiag.collectors.integrations.transformers import RldiagCallback

    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", save_strategy="no", use_cpu=True,
                             disable_tqdm=True, logging_steps=1, max_steps=1, per_device_train_batch_size=2,
                             max_grad_norm=1.0, remove_unused_columns=False)
    data = [{"x": torch.randn(4, generator=torch.Generator().manual_seed(i))} for i in range(4)]
    trainer = Trainer(model=BigLoss(), args=args, train_dataset=data)
    alerts = tmp_path / "alerts.jsonl"
    RldiagCallback(experiment="hf", tracking_uri=sqlite_uri, alerts_jsonl=alerts).attach(trainer)
    trainer.train()
    client = mlflow.MlflowClient(sqlite_uri)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    rid = run.info.run_id
    assert [m.value for m in client.get_metric_history(rid, keys.GRAD_FINITE)] == [1.0]
    assert client.get_metric_history(rid, keys.GRAD_NORM) == []
    assert not alerts.exists() or alerts.read_text() == ""


def _ddp_worker(rank: int, world: int, port: int, uri: str, out_dir: str) -> None:
    import json
    import os
    from pathlib import Path

    import torch.distributed as dist

    from tests.helpers.gloo_job import teardown

    os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    net = nn.Linear(4, 3)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    (net(x).sum() * (BIG if rank == 1 else 1.0)).backward()  # rank 1's float32 norm overflows
    with Monitor("overflow-ddp", tracking_uri=uri, spill_dir=os.path.join(out_dir, f"spill{rank}")) as mon:
        go = mon.step(0, net)
        out = {"go": go, "finite": mon.last_report.finite, "norm": mon.last_report.norm, "run_id": mon.run_id}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    teardown()


@pytest.mark.timeout(300)
def test_under_ddp_one_rank_s_overflowing_norm_is_finite_on_every_rank(sqlite_uri, tmp_path):
    import json

    import torch.multiprocessing as mp

    from tests.helpers.net import free_port

    mp.start_processes(_ddp_worker, args=(2, free_port(), sqlite_uri, str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    torch.manual_seed(0)
    net = nn.Linear(4, 3)
    (net(torch.randn(5, 4, generator=torch.Generator().manual_seed(1))).sum() * BIG).backward()
    exact = math.sqrt(math.fsum(float(p.grad.double().square().sum()) for p in net.parameters()))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:  # replicated (DDP): the largest rank's norm, rank 1's, finite on both ranks
        assert r["go"] is True and r["finite"] is True and r["norm"] == pytest.approx(exact, rel=1e-6)
    client = mlflow.MlflowClient(sqlite_uri)
    assert client.get_metric_history(ranks[0]["run_id"], keys.GRAD_NORM)[0].value == pytest.approx(exact, rel=1e-6)


def _trainer_ddp_worker(rank: int, world: int, port: int, uri: str, out: str) -> None:
    import os

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), MLFLOW_DISABLE_TELEMETRY="true")
    from transformers import Trainer, TrainingArguments

    from rldiag.collectors.integrations.transformers import RldiagCallback
    from tests.helpers.gloo_job import teardown

    args = TrainingArguments(output_dir=os.path.join(out, f"rank{rank}"), report_to="none", save_strategy="no",
                             use_cpu=True, disable_tqdm=True, logging_steps=1, max_steps=1, ddp_backend="gloo",
                             per_device_train_batch_size=2, max_grad_norm=1.0, remove_unused_columns=False)
    data = [{"x": torch.randn(4, generator=torch.Generator().manual_seed(i))} for i in range(4)]
    trainer = Trainer(model=BigLoss(), args=args, train_dataset=data)
    RldiagCallback(experiment="hf-ddp", tracking_uri=uri, alerts_jsonl=os.path.join(out, "alerts.jsonl"),
                   spill_dir=os.path.join(out, f"spill{rank}")).attach(trainer)
    trainer.train()
    teardown()


@pytest.mark.timeout(600)
def test_trainer_callback_under_ddp_logs_no_inf_norm_for_finite_gradients(sqlite_uri, tmp_path):
    """Under DDP the ranks' float32 squares overflow as well: the step is finite, its norm unknown (left out),
    never the inf of the squares or of the Trainer's own clip, and nothing is alerted."""
    pytest.importorskip("transformers")
    import torch.multiprocessing as mp

    from tests.helpers.net import free_port

    mlflow.MlflowClient(sqlite_uri).search_experiments()  # migrate before two processes race to
    mp.start_processes(_trainer_ddp_worker, args=(2, free_port(), sqlite_uri, str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    client = mlflow.MlflowClient(sqlite_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("hf-ddp").experiment_id])
    rid = run.info.run_id
    assert [m.value for m in client.get_metric_history(rid, keys.GRAD_FINITE)] == [1.0]
    # MLflow's SQL stores keep inf as max-float; rldiag flags a real inf beside it
    assert all(m.value < 1e300 for m in client.get_metric_history(rid, keys.GRAD_NORM))
    assert keys.inf_flag_key(keys.GRAD_NORM) not in run.data.metrics
    alerts = tmp_path / "alerts.jsonl"
    assert not alerts.exists() or alerts.read_text() == ""
