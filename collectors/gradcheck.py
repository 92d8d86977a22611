"""Gradient finiteness: total pre-clip norm, the finite flag, the guilty parameters, samples and tokens.

Run the check after `backward()` and before clipping and `optimizer.step()`: clipping a NaN total
norm multiplies every gradient by NaN, and afterwards every parameter looks guilty.

Cost on a finite step: one `_foreach_norm` over the gradients and one host transfer (shared with the
step's other metrics when called through `Monitor`). Only a non-finite step pays for more: an exact
per-tensor check and reading the logits probe.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from rldiag.collectors.compat.torch import foreach_norm_f32, host_dtype, queue_backward_callback

Tensor = torch.Tensor


def named_grads(params: nn.Module | Iterable[tuple[str, nn.Parameter]] | Iterable[nn.Parameter]):
    """`[(name, grad)]` of the parameters that hold a gradient; unnamed parameters are called `param.<i>`."""
    items = params.named_parameters() if isinstance(params, nn.Module) else params
    out = []
    for i, item in enumerate(items):
        name, p = item if isinstance(item, tuple) else (f"param.{i}", item)
        if p.grad is not None:
            out.append((name, p.grad))
    return out


def grad_norm_stats(grads: list[Tensor]) -> Tensor:
    """`[total_norm, norm_0, ..., norm_n-1]` as one tensor (`host_dtype`) on the first gradient's device;
    each norm is taken in float32, whatever the gradients' dtype.

    A per-tensor norm is finite whenever every element is finite (a finite tensor whose squared sum
    overflows float32 also reads non-finite: the exact check in `nonfinite_names` settles it).
    """
    if not grads:
        return torch.zeros(1)
    device = grads[0].device
    per = torch.stack([n.to(device) for n in foreach_norm_f32(grads)])
    # the total in the host dtype: float32 norms of finite tensors can add up past float32's range
    total = torch.linalg.vector_norm(per.to(host_dtype(device))).reshape(1)
    return torch.cat([total, per.to(total.dtype)])


def nonfinite_names(named: list[tuple[str, Tensor]], norms: list[float]) -> list[str]:
    """Names of the parameters whose gradient holds a NaN or inf element.

    Only tensors whose norm was non-finite are checked element by element (failure path only).
    """
    suspects = [(n, g) for (n, g), v in zip(named, norms) if not _isfinite(v)]
    if not suspects:
        return []
    flags = torch.stack([(~torch.isfinite(g)).any().to("cpu") for _, g in suspects]).tolist()
    return [n for (n, _), bad in zip(suspects, flags) if bad]


def _isfinite(v: float) -> bool:
    return v == v and v not in (float("inf"), float("-inf"))


@dataclass
class NonFinitePosition:
    """A place in the batch whose loss gradient w.r.t. the watched tensor is non-finite."""

    micro_batch: int
    sample: int
    position: int | None  # None when the watched tensor has no token dimension
    rank: int | None = None  # set under torch.distributed

    def as_dict(self) -> dict:
        d = {"micro_batch": self.micro_batch, "sample": self.sample, "position": self.position}
        if self.rank is not None:
            d["rank"] = self.rank
        return d


@dataclass
class LogitsProbe:
    """Records which samples and token positions receive non-finite gradients through a tensor.

    `watch(logits)` registers a tensor hook (call it once per micro-batch, on the model's output
    logits or any `[B, T, ...]` tensor). The hook keeps, on the device and without synchronising, a
    `[B, T]` flag per micro-batch; `positions()` reads them (failure path only). The per-position flag
    comes from the sum over the remaining dimensions, which is non-finite whenever an element is.
    """

    max_positions: int = 64
    _flags: list[Tensor] = field(default_factory=list, repr=False)

    def watch(self, tensor: Tensor) -> Tensor:
        if not tensor.requires_grad:
            return tensor
        index = len(self._flags)
        self._flags.append(torch.zeros(0, dtype=torch.bool))

        flags = self._flags

        def hook(grad: Tensor) -> None:
            if flags is not self._flags or index >= len(flags):
                return  # reset() since watch(): this backward belongs to no step being checked
            g = grad.detach()
            reduced = g.float().sum(dim=tuple(range(2, g.dim()))) if g.dim() > 2 else g.float()
            flags[index] = ~torch.isfinite(reduced)

        tensor.register_hook(hook)
        return tensor

    def positions(self) -> list[NonFinitePosition]:
        out: list[NonFinitePosition] = []
        for mb, flag in enumerate(self._flags):
            if flag.numel() == 0:
                continue
            for idx in flag.nonzero().tolist():
                out.append(NonFinitePosition(mb, idx[0], idx[1] if len(idx) > 1 else None))
                if len(out) >= self.max_positions:
                    return out
        return out

    def count(self) -> int:
        return sum(int(f.sum()) for f in self._flags if f.numel())

    def reset(self) -> None:
        self._flags = []


@dataclass
class GradReport:
    """What the check found for one step."""

    norm: float
    finite: bool
    nonfinite_params: list[str] = field(default_factory=list)
    positions: list[NonFinitePosition] = field(default_factory=list)
    nonfinite_positions: int = 0  # total count; `positions` holds at most the probe's max_positions

    def metrics(self) -> dict[str, float]:
        from rldiag.collectors import keys

        return {
            keys.GRAD_NORM: self.norm,
            keys.GRAD_FINITE: 1.0 if self.finite else 0.0,
            keys.GRAD_NONFINITE_PARAMS: float(len(self.nonfinite_params)),
        }


def check_gradients(params, probe: LogitsProbe | None = None) -> GradReport:
    """Check gradients on their own (one host synchronisation when finite). `Monitor.step` does this
    together with the step's metrics in a single transfer."""
    named = named_grads(params)
    host = grad_norm_stats([g for _, g in named]).tolist()
    return build_report(named, host, probe)


def build_report(named: list[tuple[str, Tensor]], host_norms: list[float], probe: LogitsProbe | None) -> GradReport:
    """A `GradReport` from the host copy of `grad_norm_stats`; pays for detail only when non-finite."""
    total, per = host_norms[0], host_norms[1:]
    if all(_isfinite(v) for v in per):
        return GradReport(norm=total, finite=True)  # a non-finite total here is float32 overflow
    names = nonfinite_names(named, per)
    if not names:
        return GradReport(norm=total, finite=True)  # per-tensor overflow, every element finite
    positions = probe.positions() if probe is not None else []
    count = probe.count() if probe is not None else 0
    return GradReport(norm=total, finite=False, nonfinite_params=names, positions=positions,
                      nonfinite_positions=count)


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

    `collect()` reads every norm, plus any extra scalars, in one host transfer, then resets for the
    next step. Call `remove()` to take the hooks off.
    """

    def __init__(self, named_params: Iterable[tuple[str, nn.Parameter]]):
        self.names: list[str] = []
        self._params: list[nn.Parameter] = []
        self._handles = []
        for name, p in named_params:
            if p.requires_grad:
                self.names.append(name)
                self._params.append(p)
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_accumulate))
        self.reset()

    def _on_accumulate(self, _param: Tensor) -> None:
        if not self._queued:
            self._queued = True
            queue_backward_callback(self._measure)

    def _measure(self) -> None:
        """End of a backward pass: the norms of every gradient present now."""
        self._queued = False
        seen = [i for i, p in enumerate(self._params) if p.grad is not None]
        grads = [self._params[i].grad.detach() for i in seen]
        self._seen, self._norms = seen, foreach_norm_f32(grads) if grads else []

    def nonfinite_flag(self, device: torch.device) -> Tensor:
        """A one-element tensor on `device`, 1.0 when a recorded norm is non-finite, else 0.0, built on
        the device without a host sync (for an all-reduce across ranks before `collect`)."""
        if not self._norms:
            return torch.zeros(1, device=device)
        norms = torch.stack([n.to(device) for n in self._norms])
        return (~torch.isfinite(norms)).any().to(torch.float32).reshape(1)

    def collect(self, *extra: Tensor) -> tuple[GradReport | None, list[float]]:
        """`(report, host values of extra)` in one transfer; the report is None when no parameter
        received a gradient since the last call (nothing to judge).

        `report.norm` is the total pre-clip norm. A parameter whose recorded norm is non-finite is named
        unless its gradient, read now, is all finite (its float32 norm overflowed; this check runs on
        the failure path only). Each `extra` must hold one element.
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
        self.reset()
        if not seen:
            return None, host
        per, rest = host[: len(seen)], host[len(seen) :]
        total = sum(v * v for v in per) ** 0.5
        if all(_isfinite(v) for v in per):
            return GradReport(norm=total, finite=True), rest
        suspects = [(self.names[i], self._params[i]) for i, v in zip(seen, per) if not _isfinite(v)]
        gone = [n for n, p in suspects if p.grad is None]  # cleared already: trust the recorded norm
        current = [(n, p.grad) for n, p in suspects if p.grad is not None]
        names = set(gone) | set(nonfinite_names(current, [math.inf] * len(current)))
        ordered = [n for n, _ in suspects if n in names]
        if not ordered:
            return GradReport(norm=total, finite=True), rest
        return GradReport(norm=total, finite=False, nonfinite_params=ordered), rest

    def reset(self) -> None:
        self._seen: list[int] = []
        self._norms: list[Tensor] = []
        self._queued = False  # also re-arms the hooks after a backward pass that raised midway

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.reset()
