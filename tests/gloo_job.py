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
