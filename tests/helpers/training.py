"""Small real CPU training loops and models: an MLP, the usual fp16 loop under a GradScaler, a loss that is
NaN beside finite gradients, and transformers' Trainer doing fp16 on the CPU."""

from __future__ import annotations

import torch
from torch import nn

from rldiag.collectors import Monitor


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def x_batch(step: int, b: int = 1) -> torch.Tensor:
    return torch.randn(b, 4, generator=torch.Generator().manual_seed(step))


def fp16_loop(mon: Monitor, model: nn.Module, steps: int, *, scaler: torch.amp.GradScaler, loss_fn,
              unscale_first: bool = False) -> list[dict]:
    """The usual fp16 loop: autocast forward, scaled backward, rldiag's check, unscale, clip, scaler step.
    Returns per step what the user sees: Monitor's answer and report, the scale, whether weights moved."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(steps):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            y = model(x_batch(step))
        loss = loss_fn(y.float(), step)
        scaler.scale(loss).backward()
        scale = scaler.get_scale()
        if unscale_first:
            scaler.unscale_(opt)
        go = mon.step(step, model, loss=loss, scaler=scaler)
        if not unscale_first:
            scaler.unscale_(opt)  # rldiag did not unscale: this must not raise "already been called"
        finite_grads = [p.grad for p in model.parameters() if p.grad is not None]
        true_norm = torch.nn.utils.get_total_norm(finite_grads).item()  # after unscale_: the true norm
        before = [p.detach().clone() for p in model.parameters()]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        if go:
            scaler.step(opt)
        scaler.update()
        moved = any(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
        out.append({"go": go, "report": mon.last_report, "scale": scale, "true_norm": true_norm, "moved": moved})
    return out


def nan_term_loss(model: nn.Module, step: int, nan_steps: set[int]) -> torch.Tensor:
    """MSE, plus at `nan_steps` a KL-like term computed under no_grad that is NaN (log of a negative
    number): the loss is NaN, its backward only sees the MSE, so every gradient stays finite."""
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(step))
    y = model(x)
    loss = y.pow(2).mean()
    if step in nan_steps:
        with torch.no_grad():
            kl = torch.log(y.min() - 10.0)  # log(< 0) = NaN, detached from the graph
        loss = loss + 0.1 * kl
    return loss


def cpu_fp16_trainer_class(init_scale: float = 2.0**40, backoff: float = 2.0**-30):
    """`Trainer(fp16=True)` as accelerate sets it up on a GPU, here on the CPU. accelerate refuses fp16 on the
    CPU in `Accelerator()` by a device check only (torch 2.13's CPU autocast and GradScaler do fp16), so
    after that check this sets what the GPU path sets: native AMP, mixed precision fp16 and the GradScaler,
    before `train()` prepares the model (fp16 autocast forward) and the optimizer (scaler.step + update).
    The scaler starts at 2**40 and backs off by 2**-30: the first step overflows for real, the next fits.
    `args.fp16` is set True too, after the Accelerator is made (it would refuse fp16 on the CPU), so that the
    run's params say fp16 as a GPU run's do."""
    from transformers import Trainer

    class CpuFp16Trainer(Trainer):
        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            self.accelerator.state._mixed_precision = "fp16"
            self.accelerator.native_amp = True
            self.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, backoff_factor=backoff)
            self.args.fp16 = True

    return CpuFp16Trainer
