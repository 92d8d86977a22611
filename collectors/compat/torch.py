"""torch internals rldiag relies on, in one place, each checked against the installed torch by
tests/collectors/test_compat.py."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor


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
