"""One step of the tiny 2-rank job that the distributed tests run under torch.distributed (gloo)."""

from __future__ import annotations


def gloo_step(model, rank: int, step: int, *, nan_step: int, x_scale: float = 1.0, lp_scale: float = 1.0):
    """Forward and backward on `model` (Linear(3, 4) -> Linear(4, 2)); returns (loss, policy metrics).

    At `nan_step` rank 1's loss stays finite but model[1].bias gets a NaN gradient. Policy batch:
    rank 0 has 3 valid tokens, one outside the clip band (log-ratio 0.5 x `lp_scale`); rank 1 one valid
    token, outside the band; rewards [1, 3] on rank 0 and [5] on rank 1.
    """
    import torch

    from rldiag.collectors import policy_metrics

    x = torch.ones(2, 3) * (rank + 1) * x_scale
    loss = model(x).pow(2).mean()
    if rank == 1 and step == nan_step:  # finite loss, NaN gradient in model[1].bias on rank 1 only
        b = model[1].bias
        loss = loss + 0.0 * ((b - b.detach()) ** 2).sum().sqrt()
    loss.backward()
    lp_old = torch.zeros(1, 4)
    mask = torch.tensor([[1, 1, 1, 0]] if rank == 0 else [[1, 0, 0, 0]], dtype=torch.bool)
    lp_new = torch.tensor([[0.5, 0.0, 0.0, 0.0]]) * lp_scale
    rewards = torch.tensor([1.0, 3.0]) if rank == 0 else torch.tensor([5.0])
    return loss, policy_metrics(lp_new, lp_old, mask, rewards=rewards)


# --- sharded jobs (tests/collectors/test_sharded.py) ---------------------------------------------------

SHARD_KINDS = ("fsdp2", "fsdp1-orig", "fsdp1-flat")


def nan_bias_hook(when):
    """A forward hook for a Linear: while `when()` is true its output gets `0.0 * sqrt(sum((b - b)**2))`,
    0 in the forward pass and NaN in the backward pass for the module's bias only (inside an FSDP unit's
    forward the bias is the unsharded tensor, so the NaN reaches the sharded gradient through FSDP's
    own reduce-scatter)."""

    def hook(module, _inputs, out):
        if not when():
            return out
        b = module.bias
        return out + 0.0 * ((b - b.detach()) ** 2).sum().sqrt()

    return hook


def shard_model(model, kind: str):
    """`model` (an `nn.Sequential` of Linears) sharded over the default process group on CPU: FSDP2
    (`fully_shard` per Linear, then the root), or FSDP1 (one unit per Linear) with `use_orig_params`
    True (`fsdp1-orig`) or False (`fsdp1-flat`: FlatParameters)."""
    import torch
    from torch import nn

    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            fully_shard(layer)
        return fully_shard(model)
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FullyShardedDataParallel(model, use_orig_params=kind == "fsdp1-orig", device_id=torch.device("cpu"),
                                    auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))


def full_params(model, kind: str) -> dict:
    """`{fqn: nested list}` of the full (unsharded) parameters, identical on every rank (a collective)."""
    if kind == "fsdp2":
        return {n: p.full_tensor().tolist() for n, p in model.named_parameters()}
    from torch.distributed.fsdp import FullyShardedDataParallel

    with FullyShardedDataParallel.summon_full_params(model):
        return {n: p.detach().clone().tolist() for n, p in model.named_parameters()}


def nan_weight_hook(when):
    """`nan_bias_hook` for the module's weight (a Linear without bias, e.g. Llama's MLP projections)."""

    def hook(module, _inputs, out):
        if not when():
            return out
        w = module.weight
        return out + 0.0 * ((w - w.detach()) ** 2).sum().sqrt()

    return hook


def assert_nan_run_logged(uri: str, run_id: str, *, steps: int, nan_steps: tuple[int, int],
                          norms: dict[int, float], last_param: str) -> None:
    """What rank 0 logged for a 2-rank job with NaN gradients at the two `nan_steps`: `grad/finite` per
    step, one non-finite tensor at each, no step unknown (`grad/found` is logged only as 0), `grad/norm` =
    `norms` on the finite steps, and two alerts, the last naming `last_param`."""
    import json

    import pytest
    from mlflow import MlflowClient

    client = MlflowClient(uri)

    def hist(key: str) -> dict[int, float]:
        return {m.step: m.value for m in client.get_metric_history(run_id, key)}

    assert hist("grad/finite") == {s: float(s not in nan_steps) for s in range(steps)}
    assert hist("grad/nonfinite_params") == {s: float(s in nan_steps) for s in range(steps)}
    assert hist("grad/found") == {}
    logged = hist("grad/norm")
    for step, norm in norms.items():
        assert logged[step] == pytest.approx(norm, rel=1e-5)
    tags = client.get_run(run_id).data.tags
    assert tags["rldiag.alert.count"] == "2" and tags["rldiag.alert.first_step"] == str(nan_steps[0])
    last = json.loads(tags["rldiag.alert.last"])
    assert last["step"] == nan_steps[1] and last["params"] == [last_param]


def teardown() -> None:
    """End a 2-rank test worker once its result file is written: a barrier (both ranks past every
    collective), destroy the process group, then leave with os._exit. CI saw workers abort at exit
    ('terminate called without an active exception', SIGABRT) after their job was done, the FSDP2 job's
    rank 0 and the DeepSpeed ZeRO-2 Trainer job's rank 1, as pytorch/pytorch#179291 describes for gloo
    work objects destroyed during interpreter finalization; a barrier and destroy_process_group alone
    did not prevent it. Leaving with os._exit runs no C++ destructor in a half-finalized interpreter.
    Nothing is lost by it: every job closes its Monitor (or the Trainer its callback) before this, and
    the tests read back from MLflow what it logged."""
    import os
    import sys

    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
