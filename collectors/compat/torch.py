"""torch internals rldiag relies on, in one place, each checked against the installed torch by
tests/collectors/test_compat.py."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn


def foreach_norm_f32(tensors: Sequence[Tensor]) -> list[Tensor]:
    """The float32 L2 norm of each tensor, in one fused call (`torch._foreach_norm`), on its device.

    Float32 whatever the tensors' dtype: an fp16 gradient of finite elements whose norm passes fp16's
    65504 must not read as non-finite."""
    ts = [t.detach() for t in tensors]
    if all(t.dtype in _UP_TO_F32 for t in ts):  # the usual case: one fused call
        try:
            return list(torch._foreach_norm(ts, 2.0, dtype=torch.float32))
        except TypeError:  # a torch without the dtype argument
            return [n.float() for n in torch._foreach_norm([t.float() for t in ts], 2.0)]
    # float64 (or complex) tensors: their own precision, then float32 ("dtype" may not narrow)
    return [torch.linalg.vector_norm(t.float() if t.dtype in _UP_TO_F32 else t).float() for t in ts]


_UP_TO_F32 = (torch.float16, torch.bfloat16, torch.float32)


def queue_backward_callback(fn: Callable[[], None]) -> None:
    """Run `fn` once when the current backward pass ends (the autograd engine's final callbacks);
    call it from inside a backward hook."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def host_dtype(device: torch.device) -> torch.dtype:
    """The dtype of values packed on `device` for the one host transfer: float64, except on Apple's
    MPS, which has no float64."""
    return torch.float32 if device.type == "mps" else torch.float64


# --- sharded gradients: FSDP2 (DTensor) and FSDP1 (FullyShardedDataParallel) ---------------------------
# Looked up in sys.modules, never imported: a DTensor or an FSDP1 unit can exist only once torch has loaded
# the module that defines it, so checking the gradients of a plain model loads nothing more.


def dtensor_class() -> type | None:
    """`torch.distributed.tensor.DTensor` (public) when loaded, else None."""
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


# The wrapper prefixes FSDP1 and activation checkpointing insert into parameter names
# (torch.distributed.fsdp._common_utils.FSDP_PREFIX and _CHECKPOINT_PREFIX; pinned by the tests).
FSDP_PREFIX = "_fsdp_wrapped_module."
CHECKPOINT_PREFIX = "_checkpoint_wrapped_module."
# The name under which FSDP1 registers a FlatParameter (torch.distributed.fsdp._unshard_param_utils.FLAT_PARAM).
FLAT_PARAM = "_flat_param"
# The attribute FSDP1 sets on each original parameter it flattens (..._common_utils.FSDP_FLATTENED).
FSDP_FLATTENED = "_fsdp_flattened"


def clean_fqn(name: str) -> str:
    """`name` as the parameter is called in the unwrapped model: the FSDP1 and checkpoint-wrapper
    prefixes removed (as torch.distributed.fsdp's own `clean_tensor_name` does)."""
    if "_wrapped_module." not in name:
        return name
    return name.replace(FSDP_PREFIX, "").replace(CHECKPOINT_PREFIX, "")


def flat_param_class() -> type | None:
    """`torch.distributed.fsdp.FlatParameter` (public) when loaded, else None. An FSDP1 FlatParameter
    (`use_orig_params=False`) has as `.grad` this rank's shard of the flattened, concatenated gradients
    of several original parameters."""
    return getattr(sys.modules.get("torch.distributed.fsdp"), "FlatParameter", None)


def is_flat_param(p: Tensor) -> bool:
    """`p` is an FSDP1 FlatParameter."""
    cls = flat_param_class()
    return cls is not None and isinstance(p, cls)


def fsdp1_flattened(p: Tensor) -> bool:
    """An original parameter that FSDP1 flattened into a FlatParameter (with `use_orig_params=True` its
    `.grad` is a 1-d view of the part of it in this rank's shard, or None when none is)."""
    return bool(getattr(p, FSDP_FLATTENED, False))


def flat_param_parts(flat: Tensor) -> tuple[tuple[str, int, int], ...]:
    """`(fqn, offset, numel)` of each original parameter in this rank's shard of an FSDP1 FlatParameter:
    its gradient is `flat.grad[offset : offset + numel]`. The names are relative to the FSDP1 unit's
    wrapped module."""
    infos = getattr(flat, "_shard_param_infos", None) or ()
    return tuple((fqn, info.offset_in_shard, info.numel_in_shard)
                 for fqn, info in zip(flat._fqns, infos) if info.in_shard and info.numel_in_shard)


def fsdp1_replicas(module: nn.Module) -> dict[int, int]:
    """For every FSDP1 unit inside `module`: `id` of its FlatParameter and of each original parameter
    flattened into it -> how many ranks hold the same shard of its gradient (1 for FULL_SHARD and
    SHARD_GRAD_OP, the world for NO_SHARD, the number of shard groups for HYBRID_SHARD)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:
        return {}
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    out: dict[int, int] = {}
    for unit in fsdp.FullyShardedDataParallel.fsdp_modules(module):
        flat = unit._flat_param
        if flat is None:
            continue
        if unit.sharding_strategy == fsdp.ShardingStrategy.NO_SHARD:
            replicas = world
        else:
            replicas = max(1, world // max(1, dist.get_world_size(unit.process_group))) if world > 1 else 1
        out[id(flat)] = replicas
        for p in (getattr(flat, "_params", None) or ()):
            out[id(p)] = replicas
    return out


# --- fp16 loss scaling: torch.amp.GradScaler (FSDP1's ShardedGradScaler is a subclass) ----------------


def loss_scale_tensor(scaler) -> Tensor | None:
    """The scale `scaler` multiplies the loss by, as its own one-element tensor on the device (`_scale`:
    read with the step's other values, no host sync of its own), or None when the scaler is disabled or
    has scaled nothing yet."""
    if scaler is None:
        return None
    if not isinstance(scaler, torch.amp.GradScaler):  # torch.cuda.amp's and FSDP's ShardedGradScaler subclass it
        raise TypeError(f"scaler={scaler!r} is no torch.amp.GradScaler; pass the GradScaler that scales the loss "
                        "(torch.amp.GradScaler or FSDP's ShardedGradScaler), or scaler=None without loss scaling")
    if not scaler.is_enabled():
        return None
    return getattr(scaler, "_scale", None)


def grads_unscaled(scaler, optimizer=None) -> bool:
    """Whether this step's gradients were unscaled already (`scaler.unscale_` called since the last
    `update()`): `optimizer`'s stage in the scaler is past READY; with no optimizer given, any
    optimizer's (the usual single optimizer)."""
    from torch.amp.grad_scaler import OptState

    states = scaler._per_optimizer_states
    if optimizer is not None:
        inner = getattr(optimizer, "optimizer", None)  # accelerate's AcceleratedOptimizer wraps the real one
        state = states.get(id(optimizer)) or (states.get(id(inner)) if inner is not None else None)
        return state is not None and state["stage"] is not OptState.READY
    return any(s["stage"] is not OptState.READY for s in states.values())
