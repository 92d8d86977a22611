"""`Monitor`: rldiag in a plain PyTorch loop.

    with Monitor(experiment="grpo", run_name="v1", params=cfg, policy="skip") as mon:
        for step, batch in enumerate(loader):
            logits = mon.watch(model(batch.ids).logits)          # which samples/tokens go non-finite
            lp_new = token_logprobs(logits, batch.ids)
            loss = objective(lp_new, batch.lp_old, batch.mask)
            loss.backward()
            stats = policy_metrics(lp_new, batch.lp_old, batch.mask, logits=logits, rewards=batch.rewards)
            if mon.step(step, model, loss=loss, metrics=stats):  # after backward, before clipping
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
            opt.zero_grad()
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from collectors import keys
from collectors.gradcheck import GradReport, LogitsProbe, build_report, grad_norm_stats, named_grads
from collectors.session import NonFiniteGradientError, RunSession
from collectors.writer import WriterStats

log = logging.getLogger("rldiag")

__all__ = ["Monitor", "NonFiniteGradientError"]


class Monitor:
    """Opens an MLflow run, checks gradients, logs a step's metrics in one host transfer, sends alerts.

    Keyword options are `RunSession`'s (experiment, run_name, run_id, tags, params, tracking_uri,
    policy, alerts_jsonl, webhook_url, sinks, alert_burst, alert_interval_s, spill_dir,
    close_timeout_s); see its docstring.
    """

    def __init__(self, experiment: str = "rldiag", **options: Any):
        self.session = RunSession(experiment, **options)
        self.run_id = self.session.run_id
        self.writer = self.session.writer
        self.probe = LogitsProbe()
        self.last_report: GradReport | None = None
        self._warned_no_grads = False

    @property
    def events(self) -> list[dict]:
        return self.session.events

    # ---- the loop ------------------------------------------------------------------------------
    def watch(self, tensor: torch.Tensor) -> torch.Tensor:
        """Track which samples/token positions of `tensor` (`[B, T, ...]`, e.g. logits) get non-finite
        gradients. Call once per micro-batch, before backward; returns `tensor` unchanged."""
        return self.probe.watch(tensor)

    def step(
        self,
        step: int,
        model: nn.Module | Any,
        *,
        loss: torch.Tensor | float | None = None,
        metrics: Mapping[str, torch.Tensor | float] | None = None,
    ) -> bool:
        """Check `model`'s gradients and log this step's values; True when the optimizer should step.

        Call after `backward()` and before clipping. On a finite step this costs one host transfer
        for everything (gradient norms, `loss`, `metrics`); logging never waits on the store.
        """
        named = named_grads(model)
        if not named and not self._warned_no_grads:
            self._warned_no_grads = True
            log.warning("rldiag: step %d: no parameter has a gradient; call Monitor.step after backward()", step)
        norms = grad_norm_stats([g for _, g in named])
        values: dict[str, torch.Tensor | float] = dict(metrics or {})
        if loss is not None:
            values[keys.LOSS] = loss.detach() if isinstance(loss, torch.Tensor) else loss
        host_norms, host_values = _one_transfer(norms, values)
        report = build_report(named, host_norms, self.probe)
        self.probe.reset()
        self.last_report = report
        host_values.update(report.metrics())
        self.writer.log_metrics(host_values, step)
        if report.finite:
            return True
        if self.session.on_nonfinite(step, report):
            return True
        for _, g in named:  # policy "skip"
            g.zero_()
        return False

    def log(self, metrics: Mapping[str, torch.Tensor | float], step: int) -> None:
        """Log any further values at `step` (tensors cross to the host in one transfer)."""
        from collectors.metrics import to_host

        self.writer.log_metrics(to_host(metrics), step)

    # ---- lifecycle -----------------------------------------------------------------------------
    def close(self, status: str = "FINISHED") -> WriterStats:
        """Drain the writer, send held-back alert summaries, store the alert events, end the run."""
        return self.session.close(status)

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close("FAILED" if exc_type is not None else "FINISHED")


def _one_transfer(norms: torch.Tensor, values: Mapping[str, torch.Tensor | float]) -> tuple[list[float], dict[str, float]]:
    """Host copies of the gradient norms and every tensor value, in a single device-to-host copy."""
    tensor_keys = [k for k, v in values.items() if isinstance(v, torch.Tensor)]
    out = {k: float(v) for k, v in values.items() if not isinstance(v, torch.Tensor)}
    dtype = torch.float32 if norms.device.type == "mps" else torch.float64
    parts = [norms.to(dtype)]
    for k in tensor_keys:
        v = values[k]
        if v.numel() != 1:
            raise ValueError(f"metric {k!r} has shape {tuple(v.shape)}; pass a scalar, e.g. reduce with .mean()")
        parts.append(v.detach().reshape(1).to(norms.device, dtype))
    host = torch.cat(parts).tolist()
    n = norms.numel()
    out.update(zip(tensor_keys, host[n:]))
    return host[:n], out
