"""Masked reductions over `[B, T]` token tensors, shared by the metric functions (no I/O, no host sync).

Masked positions are replaced (`torch.where`) before any arithmetic, never multiplied by zero, so a
`-inf` sentinel at padding cannot turn into NaN (`-inf * 0` and `-inf - -inf` are NaN). Masked means
divide by `mask.sum().clamp(min=1)`: an empty batch gives 0.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def _valid(mask: Tensor | None, like: Tensor) -> Tensor:
    if mask is None:
        return torch.ones_like(like, dtype=torch.bool)
    if mask.shape != like.shape:
        raise ValueError(
            f"mask has shape {tuple(mask.shape)} but the values have shape {tuple(like.shape)}; "
            "pass a [B, T] mask of valid completion tokens matching the logprobs"
        )
    return mask.bool()


def _masked_means(terms: list[Tensor], m: Tensor, count: Tensor) -> Tensor:
    """Masked means of several same-shaped terms at once, `[len(terms)]`: one stack, one `where`, one sum
    (a step's metrics are a few dozen tiny ops otherwise; each costs its dispatch). `count`: the valid
    positions, clamped to >= 1 (an empty batch gives 0)."""
    x = torch.stack(terms) if len(terms) > 1 else terms[0][None]
    total = torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device)).flatten(1).sum(1)
    return (total / count).detach()


def _masked_maxes(terms: list[Tensor], m: Tensor, empty: list[float]) -> Tensor:
    """Masked maxima of several same-shaped terms at once, `[len(terms)]`; `empty[i]` where none is valid.
    The constants are filled on the device (no host-to-device copy, which would wait for the GPU)."""
    x = torch.stack(terms) if len(terms) > 1 else terms[0][None]
    lowest = x.new_full((), float("-inf"))
    best = torch.where(m, x, lowest).flatten(1).amax(1) if m.numel() else lowest.expand(len(terms))
    fallback = x.new_zeros(len(terms))
    for i, e in enumerate(empty):
        if e:
            fallback[i] = e
    return torch.where(m.any(), best, fallback).detach()


def masked_mean(x: Tensor, mask: Tensor | None = None) -> Tensor:
    """Mean of `x` over valid positions; 0 when none is valid. Masked values may be inf or NaN."""
    m = _valid(mask, x)
    return _masked_means([x], m, m.sum().clamp(min=1))[0]


def masked_max(x: Tensor, mask: Tensor | None = None, *, empty: float = 0.0) -> Tensor:
    """Max of `x` over valid positions; `empty` when none is valid."""
    m = _valid(mask, x)
    return _masked_maxes([x], m, [empty])[0]


def _log_ratio(lp_new: Tensor, lp_old: Tensor, m: Tensor) -> Tensor:
    # Zero at masked positions: exp(0) = 1 there, and no -inf sentinel reaches the subtraction.
    zero = torch.zeros((), dtype=torch.float32, device=lp_new.device)
    return torch.where(m, lp_new.float() - lp_old.float(), zero)


def _prepared(lp_new: Tensor, lp_old: Tensor, mask: Tensor | None, *,
              rows: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """`(mask, log ratio, ratio)`, computed once and shared by the ratio-based metrics. `rows`: the caller
    needs a row per sequence (`[B, T]`: the sequence-level metrics)."""
    if lp_new.shape != lp_old.shape:
        raise ValueError(
            f"lp_new has shape {tuple(lp_new.shape)} but lp_old has shape {tuple(lp_old.shape)}; pass the "
            "trainer's and the engine's logprobs of the same completion tokens, both [B, T] (padded, with a mask)"
        )
    if rows and lp_new.dim() < 2:
        raise ValueError(
            f"logprobs of shape {tuple(lp_new.shape)}: the sequence-level metrics need [B, T], one row per "
            "completion; one sequence: lp.unsqueeze(0); packed sequences: unpack them to [B, T] with a mask"
        )
    m = _valid(mask, lp_new)
    lr = _log_ratio(lp_new, lp_old, m)
    return m, lr, lr.exp()


def _outside(x: Tensor, eps_low: float, eps_high: float) -> Tensor:
    return ((x < 1.0 - eps_low) | (x > 1.0 + eps_high)).float()
