"""Gradient finiteness: total pre-clip norm, the finite flag, the guilty parameters, samples and tokens.

Run the check after `backward()` and before clipping and `optimizer.step()`: clipping a NaN total
norm multiplies every gradient by NaN, and afterwards every parameter looks guilty.

Cost on a finite step: one `_foreach_norm` over the gradients and one host transfer (shared with the
step's other metrics when called through `Monitor`). Only a non-finite step pays for more: an exact
per-tensor check and reading the logits probe.

Where the gradients are read (`collect_grads`): a DTensor gradient (FSDP2's `fully_shard`) through its
local shard, an FSDP1 FlatParameter's gradient as this rank's shard of the original parameters it holds,
a sparse gradient through its values. Names are the parameters' original names (FQNs), without FSDP1's
or activation checkpointing's wrapper prefixes. DeepSpeed ZeRO (stages 1-3) keeps its gradients out of
`.grad`: each rank's partition of them is read from the engine's buffers (collectors/compat/deepspeed.py)
as a shard. Where no parameter holds a gradient (a call after `zero_grad` or `engine.step()`) the report
says so (`found` False, `finite` None): unknown, never finite.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from rldiag.collectors import chunks
from rldiag.collectors.chunks import Workspace, row_chunks
from rldiag.collectors.compat import deepspeed
from rldiag.collectors.compat.deepspeed import unwrap_engine
from rldiag.collectors.compat.torch import (
    FLAT_PARAM,
    clean_fqn,
    dtensor_class,
    flat_param_class,
    flat_param_parts,
    foreach_norm_f32,
    fsdp1_flattened,
    fsdp1_replicas,
    host_dtype,
)

Tensor = torch.Tensor

_SPARSE_COMPRESSED = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)

log = logging.getLogger("rldiag")


@dataclass(slots=True)
class GradEntry:
    """One parameter's gradient as this rank can measure it."""

    name: str  # the parameter's original name (FQN)
    grad: Tensor  # `.grad` itself: the skip policy zeroes this
    local: Tensor  # what is measured: dense and on this rank (a DTensor's local shard, a sparse grad's values)
    sharded: bool = False  # a shard: the ranks' squared norms add up to the global one
    replicas: int = 1  # ranks that hold this same shard (a DTensor's replicated mesh dimensions, HSDP)
    # An FSDP1 FlatParameter: `(name, offset, numel)` of each original parameter in `local`, to name them.
    parts: tuple[tuple[str, int, int], ...] = ()

    def names(self) -> list[str]:
        return [self.name] + [n for n, _, _ in self.parts]


def local_view(grad: Tensor) -> tuple[Tensor, int | None]:
    """`(dense local tensor, replicas)` of a gradient: a DTensor's local shard and how many ranks hold
    that same shard (None when `grad` is no DTensor), a sparse gradient's values (coalesced first, so
    that the norm is the tensor's: `nn.Embedding(sparse=True)` repeats the rows of repeated ids), else
    `grad`. A DTensor with a `Partial` placement (unreduced) is reduced first (a collective: every rank
    holds the same DTensors, so they all make it)."""
    dt = dtensor_class()
    if dt is not None and isinstance(grad, dt):
        placements, mesh = grad.placements, grad.device_mesh
        if any(p.is_partial() for p in placements):
            from torch.distributed.tensor import Replicate

            grad = grad.redistribute(mesh, [Replicate() if p.is_partial() else p for p in placements])
            placements = grad.placements
        replicas = 1
        for dim, p in enumerate(placements):
            if p.is_replicate():
                replicas *= mesh.size(dim)
        return local_view(grad.to_local())[0], replicas
    if grad.layout == torch.sparse_coo:
        return grad.coalesce().values(), None
    if grad.layout in _SPARSE_COMPRESSED:
        return grad.values(), None
    return grad, None


def collect_grads(params: nn.Module | Iterable[tuple[str, nn.Parameter]] | Iterable[nn.Parameter]) -> list[GradEntry]:
    """The gradients of the parameters that hold one, as this rank can measure them (see `GradEntry`).

    Detected without being told: DTensor gradients (FSDP2), FSDP1 FlatParameters (`use_orig_params=False`:
    named by the original parameters in this rank's shard) and FSDP1's original parameters
    (`use_orig_params=True`: each a shard). How many ranks hold the same FSDP1 shard (NO_SHARD,
    HYBRID_SHARD) is read from the FSDP1 units when `params` is the module, else taken as 1.
    """
    module = unwrap_engine(params) if isinstance(params, nn.Module) else None
    items = module.named_parameters() if module is not None else params
    dt = dtensor_class()  # None unless torch.distributed.tensor is loaded: no DTensor can exist then
    flat_cls = flat_param_class()  # likewise torch.distributed.fsdp, for FSDP1
    zero = deepspeed.loaded()  # DeepSpeed ZeRO keeps its gradients out of .grad
    fsdp1: dict[int, int] | None = None
    out = []
    unread: list[str] = []  # ZeRO parameters this rank owns a piece of whose gradient could not be read
    for i, item in enumerate(items):
        name, p = item if isinstance(item, tuple) else (f"param.{i}", item)
        g = p.grad
        if g is None:
            if zero and (piece := deepspeed.zero_local_grad(p)) is not None:  # this rank's partition of it
                out.append(GradEntry(clean_fqn(name), piece, piece, sharded=True))
            elif zero and deepspeed.owns_zero_grad(p):
                unread.append(clean_fqn(name))
            continue
        flat = flat_cls is not None and isinstance(p, flat_cls)
        shard = flat or (flat_cls is not None and fsdp1_flattened(p))
        if not shard and g.layout == torch.strided and (dt is None or not isinstance(g, dt)):
            out.append(GradEntry(clean_fqn(name), g, g))  # the usual case: a plain dense gradient
            continue
        local, replicas = local_view(g)
        entry = GradEntry(clean_fqn(name), g, local)
        if replicas is not None:
            entry.sharded, entry.replicas = True, replicas
        elif shard:
            if fsdp1 is None:
                fsdp1 = fsdp1_replicas(module) if module is not None else {}
            entry.sharded, entry.replicas = True, fsdp1.get(id(p), 1)
            if flat:
                prefix = entry.name[: -len(FLAT_PARAM)] if entry.name.endswith(FLAT_PARAM) else ""
                entry.parts = tuple((prefix + clean_fqn(n), off, k) for n, off, k in flat_param_parts(p))
        out.append(entry)
    if unread and any(e.sharded for e in out):  # all unread is the "no gradient" unknown, warned by Monitor.step
        _warn_unread(unread, len(unread) + sum(e.sharded for e in out))
    return out


_warned_unread: set[tuple[str, ...]] = set()


def _warn_unread(names: list[str], owned: int) -> None:
    """Once per set of names: a partial read is no all-clear for the parameters left out."""
    key = tuple(names)
    if key in _warned_unread:
        return
    _warned_unread.add(key)
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    log.warning("rldiag: DeepSpeed gave no gradient for %d of the %d ZeRO parameters this rank holds a piece of "
                "(%s): the check covers the others only, a NaN in these is not seen. Call Monitor.step between "
                "engine.backward() and engine.step(); if it already is, report this with your DeepSpeed version.",
                len(names), owned, shown)


def check_max_norm(max_norm: float | None) -> None:
    """A clear error for a `max_norm` that cannot be clipped to (before anything of the step is logged)."""
    if max_norm is None:
        return
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not 0 < max_norm < math.inf:
        raise ValueError(f"max_norm={max_norm!r}: pass the positive finite total norm to clip the gradients to "
                         "(1.0 is usual in RL), or None to leave clipping to your own clip_grad_norm_ call")


def clip_grads(entries: list[GradEntry], max_norm: float, total_norm: float) -> float:
    """Scale the gradients in place by `min(1, max_norm / (total_norm + 1e-6))`, the coefficient of
    `torch.nn.utils.clip_grad_norm_`, from a norm already measured (global under DDP/FSDP); the
    coefficient. A non-finite or float32-overflowed norm clips nothing (1.0). `max_norm` as `check_max_norm`
    passed it."""
    if not math.isfinite(total_norm):
        return 1.0
    coef = max_norm / (total_norm + 1e-6)
    if coef >= 1.0 or not entries:
        return 1.0
    plain, other = [], []
    for e in entries:  # plain dense gradients in one foreach call; DTensor, FlatParameter, sparse one by one
        (plain if e.grad.layout == torch.strided and e.grad is e.local else other).append(e.grad)
    if plain:
        torch._foreach_mul_(plain, coef)  # clip_grad_norm_'s own call; the slow path for mixed devices
    for g in other:
        g.mul_(coef)
    return coef


def named_grads(params: nn.Module | Iterable[tuple[str, nn.Parameter]] | Iterable[nn.Parameter]):
    """`[(name, gradient)]` of the parameters that hold a gradient, each as this rank measures it (see
    `collect_grads`); unnamed parameters are called `param.<i>`."""
    return [(e.name, e.local) for e in collect_grads(params)]


def grad_norm_stats(grads: list[Tensor], device: torch.device | None = None) -> Tensor:
    """`[total_norm, norm_0, ..., norm_n-1]` as one tensor (`host_dtype`) on the first gradient's device;
    each norm is taken in float32, whatever the gradients' dtype. With no gradient, `[0]` on `device`
    (CPU by default).

    A per-tensor norm is finite whenever every element is finite (a finite tensor whose squared sum
    overflows float32 also reads non-finite: the exact check in `nonfinite_names` settles it).
    """
    if not grads:
        dev = device if device is not None else torch.device("cpu")
        return torch.zeros(1, dtype=host_dtype(dev), device=dev)
    device = grads[0].device
    norms = foreach_norm_f32(grads)
    if any(n.device != device for n in norms):  # parameters on several devices (a model split by hand)
        norms = [n.to(device) for n in norms]
    per = torch.stack(norms)
    # the total in the host dtype: float32 norms of finite tensors can add up past float32's range
    total = torch.linalg.vector_norm(per.to(host_dtype(device))).reshape(1)
    return torch.cat([total, per.to(total.dtype)])


def shard_split(per: Tensor, entries: list[GradEntry], *, plain_sharded: bool = False) -> Tensor:
    """`[squares that add up across ranks, norm of the replicated rest]` from the per-tensor norms `per`
    (on their device, no host sync): a shard's squared norm divided by the ranks that hold the same shard,
    and the plain tensors' norm (replicated, as under DDP; shards too when `plain_sharded`)."""
    zero = per.new_zeros(())
    shared, rest = [], []
    a = 0
    while a < len(entries):  # runs of entries of one kind: one slice each (usually a single run)
        key = (entries[a].sharded or plain_sharded, entries[a].replicas if entries[a].sharded else 1)
        b = a + 1
        while b < len(entries) and (entries[b].sharded or plain_sharded,
                                    entries[b].replicas if entries[b].sharded else 1) == key:
            b += 1
        sq = per[a:b].square().sum()
        if key[0]:
            shared.append(sq / key[1] if key[1] != 1 else sq)
        else:
            rest.append(sq)
        a = b
    s = torch.stack(shared).sum() if shared else zero
    r = torch.stack(rest).sum().sqrt() if rest else zero
    return torch.stack([s, r])


def nonfinite_names(named: list[tuple[str, Tensor]] | list[GradEntry], norms: list[float]) -> list[str]:
    """Names of the parameters whose gradient holds a NaN or inf element.

    Only tensors whose norm was non-finite are checked element by element (failure path only); an FSDP1
    FlatParameter is checked per original parameter in it (named by the flat name when only its padding
    is non-finite).
    """
    suspects = [e for e, v in zip(_entries(named), norms) if not _isfinite(v)]
    if not suspects:
        return []
    checks: list[tuple[GradEntry, str | None, Tensor]] = []
    for e in suspects:
        checks.append((e, None, e.local))
        checks += [(e, n, e.local.reshape(-1)[off : off + k]) for n, off, k in e.parts]
    flags = torch.stack([(~torch.isfinite(t)).any().to("cpu") for _, _, t in checks]).tolist()
    bad_parts: dict[int, list[str]] = {}
    bad_whole: set[int] = set()
    for (e, n, _), bad in zip(checks, flags):
        if bad and n is None:
            bad_whole.add(id(e))
        elif bad:
            bad_parts.setdefault(id(e), []).append(n)
    out = []
    for e in suspects:
        if id(e) in bad_whole:
            out += bad_parts.get(id(e)) or [e.name]
    return out


def exact_norm(t: Tensor) -> float:
    """`t`'s L2 norm accumulated in float64 (float32 elements, on the CPU, where the device has no float64):
    finite whenever every element is. For the failure path only, where a float32 norm overflowed."""
    t = t.detach()
    if t.device.type == "mps":
        t = t.to("cpu")
    if t.is_complex():
        t = t.abs()
    return float(torch.linalg.vector_norm(t, dtype=torch.float64))


def overflow_free(named: list[tuple[str, Tensor]] | list[GradEntry], norms: list[float]) -> tuple[float, list[float]]:
    """`(total, per-tensor norms)` with every non-finite float32 norm taken again in float64: the norms of
    gradients whose elements are all finite (checked by the caller) but whose float32 squared sum overflowed."""
    per = [v if _isfinite(v) else exact_norm(e.local) for e, v in zip(_entries(named), norms)]
    return math.sqrt(math.fsum(v * v for v in per)), per


def _entries(named) -> list[GradEntry]:
    return [x if isinstance(x, GradEntry) else GradEntry(x[0], x[1], x[1]) for x in named]


def _isfinite(v: float) -> bool:
    return math.isfinite(v)


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


def _nonfinite_positions(g: Tensor) -> Tensor:
    """`[B, T]` True where the gradient's sum over the remaining dimensions is non-finite; the sum is
    taken in float32 a chunk of rows at a time (a float32 copy of a bf16 logits gradient is 2x its size)."""
    if g.dim() <= 2:
        return ~torch.isfinite(g.float())
    if g.dtype == torch.float32 or g.numel() <= chunks.CHUNK_ELEMENTS:  # no copy, or a small one: one pass
        return ~torch.isfinite(g.float().sum(dim=tuple(range(2, g.dim()))))
    rows = g.flatten(2) if g.dim() > 3 else g  # [B, T, rest]: a view unless the tail is non-contiguous
    out = torch.empty(rows.shape[:2], dtype=torch.bool, device=g.device)
    ws = Workspace(g.device)
    for idx, chunk in row_chunks(rows):
        out[idx] = ~torch.isfinite(ws.get("g", chunk.shape).copy_(chunk).sum(-1))
    return out


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
            flags[index] = _nonfinite_positions(grad.detach())

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

    def watched(self) -> bool:
        """Whether a watched tensor received its gradient since the last reset (the probe can tell)."""
        return any(f.numel() for f in self._flags)

    def count(self) -> int:
        return sum(int(f.sum()) for f in self._flags if f.numel())

    def reset(self) -> None:
        self._flags = []


@dataclass
class GradReport:
    """What the check found for one step. `finite` is None when no gradient was found: nothing was
    checked, so the step is neither finite nor non-finite (`found` is False, `norm` NaN)."""

    norm: float
    finite: bool | None
    nonfinite_params: list[str] = field(default_factory=list)
    positions: list[NonFinitePosition] = field(default_factory=list)
    nonfinite_positions: int = 0  # total count; `positions` holds at most the probe's max_positions
    scale: float | None = None  # the fp16 loss scale in play (collectors/amp.py); `norm` is unscaled
    overflow: bool = False  # non-finite from loss scaling: the scaler skips the step itself
    origin: dict | None = None  # where the NaN entered (collectors/nan_origin.py), on a non-finite step

    @classmethod
    def unknown(cls) -> GradReport:
        """No parameter held a gradient."""
        return cls(norm=math.nan, finite=None)

    @property
    def found(self) -> bool:
        return self.finite is not None

    def metrics(self) -> dict[str, float]:
        """The values logged for the step: `grad/norm`, `grad/finite`, `grad/nonfinite_params`; only
        `grad/found` = 0 when no gradient was found (no norm or flag is made up), and no `grad/norm` on a finite
        step whose norm is not known (NaN); under a loss scaler also
        `grad/loss_scale` and `grad/scaler_overflow`, and on an overflow step only these two."""
        from rldiag.collectors import keys

        if not self.found:
            return {keys.GRAD_FOUND: 0.0}
        out: dict[str, float] = {}
        if self.scale is not None:  # under a loss scaler; an overflow step is neither finite nor a NaN alert
            out[keys.GRAD_LOSS_SCALE] = self.scale
            out[keys.GRAD_SCALER_OVERFLOW] = 1.0 if self.overflow else 0.0
            if self.overflow:
                return out
        if not self.finite or math.isfinite(self.norm):  # a finite step's unknown norm is left out, never made up
            out[keys.GRAD_NORM] = self.norm
        out[keys.GRAD_FINITE] = 1.0 if self.finite else 0.0
        out[keys.GRAD_NONFINITE_PARAMS] = float(len(self.nonfinite_params))
        return out


def check_gradients(params, probe: LogitsProbe | None = None) -> GradReport:
    """Check gradients on their own (one host synchronisation when finite). `Monitor.step` does this
    together with the step's metrics in a single transfer, and agrees across ranks; this checks what
    this rank holds (its shards, under FSDP). No gradient at all: `GradReport.unknown()`."""
    entries = collect_grads(params)
    host = grad_norm_stats([e.local for e in entries]).tolist()
    return build_report(entries, host, probe)


def build_report(named: list[tuple[str, Tensor]] | list[GradEntry], host_norms: list[float],
                 probe: LogitsProbe | None) -> GradReport:
    """A `GradReport` from the host copy of `grad_norm_stats`; pays for detail only when non-finite.
    With no gradient, `GradReport.unknown()`."""
    if not named:
        return GradReport.unknown()
    total, per = host_norms[0], host_norms[1:]
    if all(_isfinite(v) for v in per):
        if not _isfinite(total):  # the total in float32 (Apple's MPS) overflowed: add the squares in float64
            total = math.sqrt(math.fsum(v * v for v in per))
        return GradReport(norm=total, finite=True)
    names = nonfinite_names(named, per)
    if not names:  # every element finite: a float32 norm overflowed; the norms again in float64, finite
        return GradReport(norm=overflow_free(named, per)[0], finite=True)
    positions = probe.positions() if probe is not None else []
    count = probe.count() if probe is not None else 0
    return GradReport(norm=total, finite=False, nonfinite_params=names, positions=positions,
                      nonfinite_positions=count)


def __getattr__(name: str):
    # AccumulatedGradCheck lives in collectors/accumulated.py (it imports this module); kept importable here
    if name == "AccumulatedGradCheck":
        from rldiag.collectors.accumulated import AccumulatedGradCheck

        return AccumulatedGradCheck
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
