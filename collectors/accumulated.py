"""`AccumulatedGradCheck`: per-parameter gradient norms recorded as gradients accumulate, for loops that
clip for you (transformers' `Trainer`)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from functools import partial

import torch
from torch import nn

from rldiag.collectors.compat.torch import (
    clean_fqn,
    foreach_norm_f32,
    fsdp1_flattened,
    fsdp1_replicas,
    host_dtype,
    is_flat_param,
    queue_backward_callback,
)
from rldiag.collectors.gradcheck import (
    GradReport,
    _isfinite,
    collect_grads,
    exact_norm,
    local_view,
    nonfinite_names,
)

Tensor = torch.Tensor


class AccumulatedGradCheck:
    """Per-parameter gradient norms, recorded as gradients accumulate (for loops that clip for you).

    A framework that clips before handing back control (transformers' `Trainer`) multiplies every
    gradient by a NaN coefficient once one is NaN, so afterwards every parameter looks guilty. This
    registers `Tensor.register_post_accumulate_grad_hook` on each parameter. The first hook of a
    backward pass queues one callback for that pass's end (the autograd engine's final callbacks),
    which takes the float32 L2 norm of every gradient in a single `_foreach_norm` and keeps the norms
    on the device: no host synchronisation, one fused call per backward instead of one op per
    parameter. A norm is non-finite whenever an element is, and non-finiteness survives accumulation
    (nan + x = nan, inf + finite = inf, inf - inf = nan), so the norms after the last micro-batch judge
    the step.

    Sharded gradients (FSDP2 DTensors, whose hooks FSDP2 runs after its reduce-scatter; FSDP1 flat
    shards) are measured on this rank's shard; `device_summary` gives what the ranks add up to the global
    norm. The order in which the first backward's hooks fire is kept (`order`): backward order, for
    naming where a NaN entered. Names are the original FQNs (FSDP1's wrapper prefixes removed).

    `collect()` reads every norm, plus any extra scalars, in one host transfer, then resets for the
    next step. Call `remove()` to take the hooks off.
    """

    def __init__(self, named_params: Iterable[tuple[str, nn.Parameter]], module: nn.Module | None = None):
        self.names: list[str] = []
        self._params: list[nn.Parameter] = []
        self._handles = []
        for name, p in named_params:
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(partial(self._on_accumulate,
                                                                                  len(self._params))))
                self.names.append(clean_fqn(name))
                self._params.append(p)
        # ranks holding the same FSDP1 shard (NO_SHARD, HYBRID_SHARD), read once from the module's units
        self._fsdp1 = fsdp1_replicas(module) if module is not None else {}
        self._last_order: list[int] = []
        self.reset()

    def _on_accumulate(self, index: int, _param: Tensor) -> None:
        if self._recording:
            self._order.append(index)
        if not self._queued:
            self._queued = True
            queue_backward_callback(self._measure)

    def _measure(self) -> None:
        """End of a backward pass: the norms of every gradient present now."""
        self._queued = False
        self._recording = False  # the first backward of the step gave the order
        seen = [i for i, p in enumerate(self._params) if p.grad is not None]
        views = [local_view(self._params[i].grad.detach()) for i in seen]
        self._replicas = [r if r is not None else self._flat_replicas(self._params[i])
                          for i, (_, r) in zip(seen, views)]
        grads = [v for v, _ in views]
        self._seen, self._norms = seen, foreach_norm_f32(grads) if grads else []

    def _flat_replicas(self, p: Tensor) -> int | None:
        """Ranks that hold this FSDP1 shard, or None when `p` is no FSDP1 shard (a replicated tensor)."""
        if is_flat_param(p) or fsdp1_flattened(p):
            return self._fsdp1.get(id(p), 1)
        return None

    def device_summary(self, device: torch.device, world: int = 1) -> Tensor:
        """`[non-finite flag, squared norm of the shards / their replicas, squared norm of the replicated
        tensors / world]` on `device`, without a host sync: summed over `world` ranks (one SUM all-reduce)
        it is `[ranks with a non-finite gradient, the global norm's square in two parts]`."""
        dtype = host_dtype(device)
        if not self._norms:
            return torch.zeros(3, dtype=dtype, device=device)
        norms = torch.stack([n.to(device) for n in self._norms]).to(dtype)
        shard_w = torch.tensor([1.0 / r if r is not None else 0.0 for r in self._replicas], dtype=dtype, device=device)
        rest_w = torch.tensor([0.0 if r is not None else 1.0 / world for r in self._replicas], dtype=dtype,
                              device=device)
        sq = norms.square()
        bad = (~torch.isfinite(norms)).any().to(dtype)
        return torch.stack([bad, (sq * shard_w).sum(), (sq * rest_w).sum()])

    def sharded_names(self) -> set[str]:
        """Names of the parameters whose last measured gradient is a shard (every rank holds a piece)."""
        return {self.names[i] for i, r in zip(self._seen, self._replicas) if r is not None}

    def order(self) -> list[str]:
        """The parameters in the order their gradients first arrived in the step `collect` judged last
        (backward order)."""
        return [self.names[i] for i in dict.fromkeys(self._last_order)]

    def collect(self, *extra: Tensor) -> tuple[GradReport | None, list[float]]:
        """`(report, host values of extra)` in one transfer; the report is None when no parameter
        received a gradient since the last call (nothing to judge).

        `report.norm` is the total pre-clip norm (of this rank's gradients). A parameter whose recorded
        norm is non-finite is named unless its gradient, read now, is all finite (its float32 norm
        overflowed; this check runs on the failure path only). Each `extra` must hold one element.
        """
        seen, norms = self._seen, self._norms
        if not seen and not extra:
            self.reset()
            return None, []
        device = norms[0].device if seen else extra[0].device
        dtype = host_dtype(device)
        parts = []
        if seen:
            parts.append(torch.stack([n.to(device) for n in norms]).to(dtype))
        for x in extra:
            if x.numel() != 1:
                raise ValueError(f"extra value has shape {tuple(x.shape)}; pass one-element tensors")
            parts.append(x.detach().reshape(1).to(device, dtype))
        host = torch.cat(parts).tolist()
        self._last_order = self._order  # read by order() on this step's failure path
        self.reset()
        if not seen:
            return None, host
        per, rest = host[: len(seen)], host[len(seen) :]
        total = sum(v * v for v in per) ** 0.5
        if all(_isfinite(v) for v in per):
            return GradReport(norm=total, finite=True), rest
        suspects = [(self.names[i], self._params[i]) for i, v in zip(seen, per) if not _isfinite(v)]
        gone = [n for n, p in suspects if p.grad is None]  # cleared already: trust the recorded norm
        # read now through collect_grads: an FSDP1 FlatParameter is named by the parameters in it
        current = collect_grads([(n, p) for n, p in suspects if p.grad is not None])
        names = set(gone) | set(nonfinite_names(current, [math.inf] * len(current)))
        ordered = [n for n, _ in suspects if n in names] + sorted(names - {n for n, _ in suspects})
        if not ordered:  # every element finite: float32 norms overflowed
            return GradReport(norm=_overflowed_total(per, current), finite=True), rest
        return GradReport(norm=total, finite=False, nonfinite_params=ordered), rest

    def reset(self) -> None:
        self._seen: list[int] = []
        self._norms: list[Tensor] = []
        self._replicas: list[int | None] = []
        self._order: list[int] = []
        self._recording = True
        self._queued = False  # also re-arms the hooks after a backward pass that raised midway

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.reset()


def _overflowed_total(per: list[float], current: list) -> float:
    """The total norm where the recorded float32 norms of finite gradients (`current`, in the order of the
    non-finite values in `per`) overflowed: each taken again in float64 from the gradient as it is now, or
    NaN (unknown) where it changed since (clipped with the overflowed norm, as torch's clip_grad_norm_
    does: to zero)."""
    if len(current) != sum(not math.isfinite(v) for v in per):
        return math.nan
    exact = iter([exact_norm(e.local) if not math.isfinite(foreach_norm_f32([e.local])[0].item()) else math.nan
                  for e in current])
    return math.sqrt(math.fsum(v * v if math.isfinite(v) else next(exact) ** 2 for v in per))
