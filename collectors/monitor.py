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

With fp16 and a GradScaler: `mon.step(step, model, loss=loss, scaler=scaler)`, then `scaler.step(opt)` and
`scaler.update()` as usual (see `step`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Self

import torch
from torch import nn

from rldiag.collectors import distributed, keys
from rldiag.collectors.compat import deepspeed
from rldiag.collectors.compat.deepspeed import fp16_loss_scale, fp16_without_engine, unwrap_engine
from rldiag.collectors.compat.torch import grads_unscaled, host_dtype, loss_scale_tensor
from rldiag.collectors.gradcheck import (
    GradEntry,
    GradReport,
    LogitsProbe,
    build_report,
    check_max_norm,
    clip_grads,
    collect_grads,
    grad_norm_stats,
    overflow_free,
    shard_split,
)
from rldiag.collectors.loss_event import EmptyBatchCheck
from rldiag.collectors.metrics import pack, to_host
from rldiag.collectors.nan_origin import autograd_order
from rldiag.collectors.nonfinite import NonFinitePolicy, check_policy
from rldiag.collectors.session import NonFiniteGradientError, RunSession
from rldiag.collectors.writer import WriterStats

log = logging.getLogger("rldiag")

__all__ = ["Monitor", "NonFiniteGradientError"]


def _device_of(model: Any, values: Mapping[str, Any]) -> torch.device:
    """Where a step without gradients packs its values: the model's, else the first tensor value's (a
    NCCL all-reduce needs them on the GPU), else the CPU."""
    if isinstance(model, nn.Module):
        for p in model.parameters():
            return p.device
    for v in values.values():
        if isinstance(v, torch.Tensor):
            return v.device
    return torch.device("cpu")


class Monitor:
    """Opens an MLflow run, checks gradients, logs a step's metrics in one host transfer, sends alerts.

    Keyword options are `RunSession`'s (experiment, run_name, run_id, tags, params, tracking_uri,
    policy, alerts_jsonl, webhook_url, sinks, alert_burst, alert_interval_s, spill_dir,
    close_timeout_s; see its docstring), plus, under torch.distributed (an initialised process group
    of more than one rank): `per_rank` (also log each rank's values as `rank<r>/<key>`) and
    `grads_sharded` (plain-tensor gradients are shards: the total norm sums the ranks' squares; default
    False, DDP). FSDP2's DTensor gradients and FSDP1's (FlatParameter, or `use_orig_params=True`) are
    recognised as shards without it, named by their original FQNs. So are DeepSpeed ZeRO 1-3's gradient
    partitions (out of `.grad`, read from the engine's buffers): pass the engine (its fp16 loss scale is read
    from it), call `step` after `engine.backward(loss)` and before `engine.step()`, and under `skip` leave
    out `engine.step()` where it returns False (the partitions are zeroed). Every rank creates a Monitor
    and calls `step`; all ranks agree on the finite flag; rank 0 opens the run and writes.

    A step where no parameter holds a gradient (a call after `zero_grad` or `engine.step()`) is unknown,
    never finite: it logs `grad/found` = 0 and no `grad/norm` or `grad/finite`, warns once, and returns
    True (there is nothing to skip).

    What a checked step leads to (scaler, NaN origin, `grad/*` keys, alert, policy) is `NonFinitePolicy`'s
    (collectors/nonfinite.py), shared with the transformers callback: the policy is the run param
    `rldiag.nonfinite_policy`, and a non-finite step logs `grad/skipped` (1: the weights did not change).
    """

    def __init__(self, experiment: str = "rldiag", *, per_rank: bool = False, grads_sharded: bool = False,
                 **options: Any):
        self.distributed = distributed.active()
        self.rank = torch.distributed.get_rank() if self.distributed else 0
        self.policy = check_policy(options.get("policy", "warn"))
        self.nonfinite = NonFinitePolicy(self.policy, rank=self.rank, no_grad_hint=(
            "call Monitor.step after backward() and before zero_grad(); under DeepSpeed after engine.backward() "
            "and before engine.step(), at the accumulation boundary"))
        self.session = RunSession(experiment, **options) if self.rank == 0 else None
        self.run_id = self.session.run_id if self.session else None
        self.writer = self.session.writer if self.session else None
        self.per_rank, self.grads_sharded = per_rank, grads_sharded
        self.probe = LogitsProbe()
        self.last_report: GradReport | None = None
        self._empty_check = EmptyBatchCheck()
        self.nonfinite.record(self.session)
        self._checked_engine = False
        self._warned_zero_skip = False

    @property
    def events(self) -> list[dict]:
        return self.session.events if self.session else []

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
        scaler: Any = None,
        optimizer: Any = None,
        max_norm: float | None = None,
    ) -> bool:
        """Check `model`'s gradients and log this step's values; True when the optimizer should step.

        Call after `backward()` and before clipping. On a finite step this costs one host transfer
        for everything (gradient norms, `loss`, `metrics`); logging never waits on the store.

        fp16 with a `torch.amp.GradScaler`: pass it as `scaler` (and `optimizer` when there are several);
        `grad/norm` is then the unscaled norm whether or not `scaler.unscale_` ran first, a scaler overflow
        is logged as `grad/scaler_overflow` (no NaN alert), and step returns True on every non-finite step,
        since `scaler.step` skips those itself (see collectors/amp.py). Pass `loss` as the tensor: on a
        non-finite step its autograd graph gives the backward order that names where the NaN entered.

        `max_norm`: clip the gradients to this total norm with the norm just checked, as
        `torch.nn.utils.clip_grad_norm_(params, max_norm)` would, in place of that call: one pass over the
        gradients instead of two, and no second all-reduce under DDP or FSDP (the norm is already global).
        Only finite steps are clipped; under a GradScaler the coefficient comes from the unscaled norm, so
        it may run before or after `scaler.unscale_`.
        """
        check_max_norm(max_norm)
        ds_scale = None
        engine = model
        if isinstance(model, nn.Module):
            ds_scale = fp16_loss_scale(model)  # a DeepSpeedEngine in fp16: its gradients are still scaled
            if not self._checked_engine:  # once: the parameters are walked
                self._checked_engine = True
                if ds_scale is None and self.rank == 0 and fp16_without_engine(model):
                    log.warning("rldiag: the model passed to Monitor.step holds fp16 DeepSpeed ZeRO parameters but "
                                "is not the DeepSpeedEngine, so DeepSpeed's loss scale cannot be read: grad/norm "
                                "is the scaled norm and a scaler overflow reads as a NaN. Pass the engine "
                                "(mon.step(step, engine, ...)), not engine.module.")
                if self.policy == "skip" and self.rank == 0 and (micro := deepspeed.accumulation_steps(model)) > 1:
                    log.warning("rldiag: policy 'skip' under DeepSpeed gradient accumulation (%d micro-batches a step) "
                                "is not supported: leaving out engine.step() at the boundary shifts DeepSpeed's count "
                                "of micro-batches, so later steps accumulate the wrong ones. Use policy 'warn' or "
                                "'raise' there, or 'skip' without gradient accumulation.", micro)
            model = unwrap_engine(model)  # a DeepSpeedEngine: its model's own parameter names
        entries = collect_grads(model)
        values: dict[str, torch.Tensor | float] = dict(metrics or {})
        if loss is not None:
            values[keys.LOSS] = loss.detach() if isinstance(loss, torch.Tensor) else loss
        scale_t = loss_scale_tensor(scaler)  # DeepSpeed's scale is a host float already: not in the transfer
        if scale_t is not None:  # read in the same host transfer
            values[keys.GRAD_LOSS_SCALE] = scale_t
        if self.distributed:  # reduced by key: every rank lays its values out in the same (sorted) order
            values = dict(sorted(values.items()))
        norms = grad_norm_stats([e.local for e in entries], device=None if entries else _device_of(model, values))
        vec = torch.cat([norms.to(host_dtype(norms.device)), pack(values, device=norms.device)])
        n = norms.numel()
        if not self.distributed:
            host = vec.tolist()  # the one host transfer
            report = build_report(entries, host[:n], self.probe)
        else:
            report, host = self._reduce(vec, n, list(values), entries, step)
        got = dict(zip(values.keys(), host[n : n + len(values)]))
        scale = got[keys.GRAD_LOSS_SCALE] if scale_t is not None else ds_scale
        # DeepSpeed's gradients before engine.step() are always still scaled
        scaled = scale_t is None or not grads_unscaled(scaler, optimizer)
        order, how = ([], "unknown")
        if report.found and report.finite is False and self.rank == 0:  # failure path: the backward order
            order, how = autograd_order(loss, model if isinstance(model, nn.Module) else None)
        report = self.nonfinite.judge(report if report.found else None, scale=scale, scaled=scaled,
                                      loss=got.get(keys.LOSS), order=order, how=how, watched=self.probe.watched())
        self.probe.reset()
        self.last_report = report
        logged = dict(got)
        if self.per_rank and len(host) > n + len(values):
            per = host[n + len(values):]
            for r in range(len(per) // max(1, len(values))):
                for j, k in enumerate(values):
                    logged[f"rank{r}/{k}"] = per[r * len(values) + j]
        if report.finite and max_norm is not None:
            clip_grads(entries, max_norm, report.norm)
        if self.session is not None:
            self._empty_check.update(step, got.get(keys.BATCH_TOKENS))
        if self.nonfinite.settle(self.session, step, report, logged, loss=got.get(keys.LOSS)):
            return True
        for e in entries:  # policy "skip", on every rank
            e.grad.zero_()
        if not deepspeed.restart_accumulation(engine) and deepspeed.zero_model(model):
            if not self._warned_zero_skip and self.rank == 0:
                self._warned_zero_skip = True
                log.warning("rldiag: step %d skipped on DeepSpeed ZeRO parameters, but the model passed is not the "
                            "DeepSpeedEngine: its next backward may add to this step's gradient (ZeRO-Offload). "
                            "Pass the engine (mon.step(step, engine, ...)).", step)
        return False

    def _reduce(self, vec: torch.Tensor, n: int, value_keys: list[str],
                entries: list[GradEntry], step: int) -> tuple[GradReport, list[float]]:
        split = None
        if any(e.sharded for e in entries):  # FSDP shards (possibly beside replicated tensors)
            split = shard_split(vec[1:n], entries, plain_sharded=self.grads_sharded)
        red = distributed.reduce_step(vec, n, value_keys, sharded=self.grads_sharded, per_rank=self.per_rank,
                                      split=split, found=bool(entries), step=step)
        parts = [red.vector, red.nonfinite_ranks.reshape(1), red.found_ranks.reshape(1)]
        if red.per_rank is not None:
            parts.append(red.per_rank.reshape(-1))
        host_all = torch.cat(parts).tolist()  # the one host transfer
        k = vec.numel()
        host = host_all[:k] + host_all[k + 2 :]
        if host_all[k + 1] == 0:  # no rank found any gradient
            return GradReport.unknown(), host
        if host_all[k] == 0:
            return GradReport(norm=host[0], finite=True), host
        # Some rank is non-finite: every rank takes this path, so the collective below matches up.
        local_norms = vec[:n].tolist()
        local = build_report(entries, local_norms, self.probe)
        shared = {name for e in entries if e.sharded or self.grads_sharded for name in e.names()}
        names, positions, _ = distributed.gather_failure(local.nonfinite_params, local.positions, shared=shared)
        if not names:  # every rank's tensors are finite: a float32 norm overflowed, not a NaN
            norm = self._overflow_free_norm(vec, local_norms[1:n], entries, step)
            return GradReport(norm=norm, finite=True), host
        return GradReport(norm=host[0], finite=False, nonfinite_params=names, positions=positions,
                          nonfinite_positions=len(positions)), host

    def _overflow_free_norm(self, vec: torch.Tensor, per: list[float], entries: list[GradEntry], step: int) -> float:
        """The global norm again from each rank's norms taken in float64 where float32 overflowed (every rank
        calls this: the same collectives)."""
        _, exact = overflow_free(entries, per)
        per_t = torch.tensor(exact or [0.0], dtype=vec.dtype, device=vec.device)
        v = torch.cat([torch.linalg.vector_norm(per_t).reshape(1), per_t])
        split = None
        if any(e.sharded for e in entries):
            split = shard_split(per_t, entries, plain_sharded=self.grads_sharded)
        red = distributed.reduce_step(v, v.numel(), [], sharded=self.grads_sharded, split=split,
                                      found=bool(entries), step=step)
        return float(red.vector[0])

    def log(self, metrics: Mapping[str, torch.Tensor | float], step: int) -> None:
        """Log any further values at `step` (tensors cross to the host in one transfer; rank 0 only)."""
        if self.writer is not None:
            host = to_host(metrics)
            self.writer.log_metrics(host, step)
            if keys.BATCH_TOKENS in host:
                self._empty_check.update(step, host[keys.BATCH_TOKENS])

    # ---- lifecycle -----------------------------------------------------------------------------
    def close(self, status: str = "FINISHED") -> WriterStats | None:
        """Drain the writer, send held-back alert summaries, store the alert events, end the run."""
        return self.session.close(status) if self.session else None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close("FAILED" if exc_type is not None else "FINISHED")
