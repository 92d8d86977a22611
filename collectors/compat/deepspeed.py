"""DeepSpeed ZeRO internals rldiag reads, in one place: where a parameter's gradient is after
`engine.backward(loss)` and before `engine.step()`, as this rank holds it. ZeRO keeps gradients out of
`.grad`:
- stages 1 and 2: each rank owns a partition of the flat gradient; `param._hp_mapping` (None on a rank
  that owns no piece of the parameter) locates this rank's fragment in it (`get_lp_grad_fragment`, what
  `deepspeed.utils.safe_get_full_grad` reads before the all-reduce that assembles the full gradient);
- stage 3: `param._z3_optimizer._get_fp32_grad_state_partition(param)`, this rank's partition of the
  parameter's gradient, the buffer itself (`deepspeed.utils.safe_get_local_grad` returns it as a float32
  copy under bf16, which `skip` could not zero).
Every rank's piece is its own, so the squared norms add up over the ranks (shards held by one rank) and no
collective is needed to read them. Nothing is imported from DeepSpeed: the attributes are read where a
parameter has them (tests/collectors/test_deepspeed.py pins them against the installed DeepSpeed).
"""

from __future__ import annotations

import math
import sys

import torch
from torch import Tensor


def loaded() -> bool:
    """DeepSpeed has been imported in this process (no ZeRO parameter can exist otherwise)."""
    return "deepspeed" in sys.modules


def zero_local_grad(p: torch.nn.Parameter) -> Tensor | None:
    """This rank's piece of `p`'s gradient under DeepSpeed ZeRO, flat, or None: `p` is no ZeRO parameter,
    this rank owns none of it, or the engine holds no gradient now (before backward, after step, or
    between the micro-batches of an accumulation)."""
    z3 = getattr(p, "_z3_optimizer", None)
    if z3 is not None and hasattr(p, "ds_id"):
        if not p.requires_grad:
            return None
        try:  # the partition itself, in the training dtype: `skip` zeroes it in place
            g, _ = z3._get_fp32_grad_state_partition(param=p, release_swap_buffers=True)
        except (KeyError, ValueError, AttributeError, RuntimeError, TypeError):  # no partition of it reduced yet
            return None
        return None if g is None else g.reshape(-1)
    mapping = getattr(p, "_hp_mapping", None)
    if mapping is None:
        return None
    try:
        g = mapping.get_lp_grad_fragment(p._index_in_param_group)
    except (ValueError, KeyError, IndexError, AttributeError):  # "only available immediately after backward"
        return None
    g = g.reshape(-1)
    address = mapping.lp_fragment_address
    if g.numel() == p.numel() and address.numel != p.numel():  # a whole-parameter buffer: this rank's part
        g = g.narrow(0, address.start, address.numel)
    return g


def owns_zero_grad(p: torch.nn.Parameter) -> bool:
    """This rank is meant to hold a piece of `p`'s gradient under ZeRO: a stage 1-2 parameter with a fragment
    mapping here, or a stage 3 parameter that trains with a partition on this rank. Where `zero_local_grad`
    still reads nothing for such a parameter while it reads others, that parameter went unchecked."""
    if getattr(p, "_z3_optimizer", None) is not None and hasattr(p, "ds_id"):
        tensor = getattr(p, "ds_tensor", None)
        return p.requires_grad and (tensor is None or tensor.numel() > 0)
    return getattr(p, "_hp_mapping", None) is not None


def is_zero_param(p: torch.nn.Parameter) -> bool:
    """`p` is managed by a ZeRO optimizer (stage 1-3), whether or not this rank owns a piece of it."""
    return hasattr(p, "_hp_mapping") or (hasattr(p, "ds_id") and hasattr(p, "_z3_optimizer"))


def _is_engine(module) -> bool:
    return loaded() and type(module).__name__ == "DeepSpeedEngine"


def unwrap_engine(module: torch.nn.Module) -> torch.nn.Module:
    """The model inside a `DeepSpeedEngine` (whose own parameter names carry a `module.` prefix), else
    `module` itself."""
    if _is_engine(module) and isinstance(getattr(module, "module", None), torch.nn.Module):
        return module.module
    return module


def fp16_loss_scale(module) -> float | None:
    """The loss scale of a `DeepSpeedEngine` training in fp16 (its optimizer's `loss_scale`: the gradients
    read between `engine.backward` and `engine.step` are the true ones times it), else None. Not run on
    these machines: DeepSpeed's fp16 needs CUDA (tests/gpu/deepspeed_zero.py)."""
    if not _is_engine(module):
        return None
    try:
        if not module.fp16_enabled():
            return None
        scale = float(module.optimizer.loss_scale)
    except (AttributeError, TypeError, ValueError):
        return None
    return scale


def accumulation_steps(module) -> int:
    """Micro-batches per optimizer step of a `DeepSpeedEngine` (its `gradient_accumulation_steps()`), else 1."""
    if not _is_engine(module):
        return 1
    try:
        return int(module.gradient_accumulation_steps())
    except (AttributeError, TypeError, ValueError):
        return 1


def restart_accumulation(module) -> bool:
    """After a step the loop leaves out (`skip`): make a `DeepSpeedEngine`'s next backward start a fresh
    gradient, as its own `engine.step()` would, instead of adding to the skipped one. DeepSpeed counts
    backwards in its ZeRO optimizer's `micro_step_id` and resets it only in its step; left as it is, the next
    backward counts as a second micro-batch and accumulates onto buffers rldiag does not read under
    ZeRO-Offload (stage 1-2: the CPU accumulation buffers hold an earlier step's gradient; stage 3: the NaN
    stays in the partition it accumulates into). Stage 3's own `zero_grad` resets its count; stage 1-2's
    does not, so the count is set to its start value. False where `module` is no engine (nothing reset)."""
    if not _is_engine(module):
        return False
    opt = getattr(module, "optimizer", None)
    if opt is None or not hasattr(opt, "micro_step_id"):
        return False
    if hasattr(opt, "_get_fp32_grad_state_partition"):  # ZeRO 3 (its optimizer class; stage 1-2's has no such method)
        opt.zero_grad(set_to_none=True)
    else:  # ZeRO 1-2: what its step() sets first
        opt.micro_step_id = getattr(sys.modules.get(type(opt).__module__), "INITIAL_MICRO_STEP_ID", -1)
    return True


def fp16_without_engine(module) -> bool:
    """`module` holds fp16 ZeRO parameters but is no `DeepSpeedEngine` (e.g. `engine.module`): DeepSpeed's
    loss scale cannot be read from it, so its gradients would be taken for the true ones."""
    if not loaded() or _is_engine(module) or not isinstance(module, torch.nn.Module):
        return False
    return any(p.dtype == torch.float16 and is_zero_param(p) for p in module.parameters())


def zero_model(model: torch.nn.Module) -> bool:
    """Some parameter of `model` is managed by a DeepSpeed ZeRO optimizer."""
    return loaded() and any(is_zero_param(p) for p in model.parameters())


def stepped_norm(optimizer) -> float | None:
    """DeepSpeed's own pre-clip global norm of the step it has just taken: its ZeRO optimizer's
    `_global_grad_norm` (what `engine.get_global_grad_norm()` returns), found behind accelerate's
    `DeepSpeedOptimizerWrapper`; None where there is none or it is no finite norm (DeepSpeed stores inf
    for a step it skipped)."""
    inner = optimizer
    for _ in range(3):  # accelerate's wrapper -> DeepSpeed's ZeRO optimizer
        if inner is None or hasattr(inner, "_global_grad_norm"):
            break
        inner = getattr(inner, "optimizer", None)
    value = getattr(inner, "_global_grad_norm", None)
    try:
        value = float(value) if value is not None else None
    except (TypeError, ValueError, RuntimeError):
        return None
    return value if value is not None and math.isfinite(value) and value >= 0 else None
