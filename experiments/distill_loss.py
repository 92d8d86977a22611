"""The sparse top-1 divergence loss of TRL's server-backed distillation path, with and without the fix.

A faithful port of `DistillationTrainer._compute_server_sparse_top_1_divergence_loss` (TRL v1.1.0,
`trl/experimental/distillation/distillation_trainer.py`) and the helpers it calls (`_add_tail_bucket`,
`_jsd_divergence`, `_reduce_divergence_loss`), as seeds/trl-distillation-nan-pr.txt describes them.

The teacher's logprobs arrive per sample (ragged) and are padded into `[B, T]` with the `-inf`
sentinel (`pad_ragged`). Unmasked, at a padding position the teacher's top-1 slot is `-inf` and its
tail bucket `log(1 - exp(-inf)) = 0`; reverse KL's `p_s * (log p_s - log p_t)` is `p_s * inf = +inf`,
which `nan_to_num` turns into max-float and the label mask then drops, so the loss is finite. Backward,
the dropped position's upstream gradient is 0 and the product's rule computes `d/dp_s = 0 * inf = NaN`,
which flows into the student's logits at that position and from there into every parameter. The fix
(`mask_padding=True`) replaces the sentinel at padding with 0 before any divergence math.

Shapes: `B` samples, `T` completion positions, `V` vocabulary, `S` support slots (1 for reverse KL,
2 for JSD, plus the tail bucket).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

Tensor = torch.Tensor


class TeacherLogprobs(NamedTuple):
    """What the teacher server returns, padded to `[B, T]` (`-inf` / token id 0 at padding)."""

    actual: Tensor  # [B, T] teacher logprob of the sampled (completion) token
    top1: Tensor  # [B, T] teacher's largest logprob
    top1_ids: Tensor  # [B, T] the token id of that logprob


class Divergence(NamedTuple):
    """The loss and the detached parts behind it."""

    loss: Tensor  # 0-d, mean over valid tokens of the per-token divergence (TRL's "batchmean")
    per_slot: Tensor  # [B, T, S] detached divergence per support slot; the last slot is the tail bucket
    teacher_nonfinite: Tensor  # 0-d count of non-finite teacher logprobs that reached the divergence math


def pad_ragged(rows: Sequence[Tensor], width: int, fill: float) -> Tensor:
    """`[len(rows), width]`: each 1-d row at the start of its line, `fill` after it (TRL's `_actual_to_tensor`)."""
    out = torch.full((len(rows), width), fill, dtype=rows[0].dtype if rows else torch.float32)
    for i, row in enumerate(rows):
        out[i, : row.numel()] = row
    return out


def add_tail_bucket(log_probs: Tensor, valid_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Append `log(1 - sum(exp(log_probs)))` as a last slot, and a True mask entry for it.

    `log_probs` `[..., S]` -> `[..., S + 1]`. An all `-inf` row gets the tail `log(1 - 0) = 0`.
    """
    log_sum = torch.logsumexp(log_probs, dim=-1, keepdim=True).clamp(max=-1e-7)  # keep the sum below 1
    tail = torch.log(-torch.expm1(log_sum))
    tail_mask = torch.ones_like(valid_mask[..., :1], dtype=torch.bool)
    return torch.cat([log_probs, tail], dim=-1), torch.cat([valid_mask, tail_mask], dim=-1)


def jsd_divergence(student_log_probs: Tensor, teacher_log_probs: Tensor, beta: float, support_mask: Tensor) -> Tensor:
    """Per-slot generalised JSD over a fixed support: beta 0 forward KL, 1 reverse KL, between: JSD.

    Masked slots are zeroed with `torch.where`; `nan_to_num` clamps each KL term, which keeps the
    forward pass finite but does not stop NaN in the backward pass (the point of this experiment).
    """
    zeros = torch.zeros_like(student_log_probs)
    safe_student = torch.where(support_mask, student_log_probs, zeros)
    safe_teacher = torch.where(support_mask, teacher_log_probs, zeros)
    student_probs = torch.where(support_mask, student_log_probs.exp(), zeros)
    teacher_probs = torch.where(support_mask, teacher_log_probs.exp(), zeros)
    if beta == 0:
        return torch.nan_to_num(teacher_probs * (safe_teacher - safe_student), nan=0.0)
    if beta == 1:
        return torch.nan_to_num(student_probs * (safe_student - safe_teacher), nan=0.0)
    tiny = torch.finfo(student_probs.dtype).tiny
    mixture = (1 - beta) * student_probs + beta * teacher_probs
    safe_mixture = torch.where(support_mask, torch.log(mixture.clamp_min(tiny)), zeros)
    kl_teacher = torch.nan_to_num(teacher_probs * (safe_teacher - safe_mixture), nan=0.0)
    kl_student = torch.nan_to_num(student_probs * (safe_student - safe_mixture), nan=0.0)
    return beta * kl_teacher + (1 - beta) * kl_student


def reduce_divergence_loss(jsd: Tensor, required: Tensor) -> Tensor:
    """Sum over the valid tokens' slots divided by the number of valid tokens (0 with a gradient when none)."""
    picked = jsd[required]  # boolean indexing: padding positions are left out of the forward value
    n = required.sum()
    return picked.sum() / n.clamp(min=1)


def sparse_top1_divergence(
    student_log_probs: Tensor,
    teacher: TeacherLogprobs,
    completion_tokens: Tensor,
    required: Tensor,
    *,
    beta: float,
    add_tail: bool = True,
    mask_padding: bool,
) -> Divergence:
    """TRL's server-path sparse top-1 divergence of the student from the teacher.

    `student_log_probs` `[B, T, V]` (log-softmax of the student's completion logits),
    `completion_tokens` `[B, T]` (the sampled tokens; the reverse-KL support), `required` `[B, T]` bool
    (valid completion tokens, TRL's `labels != -100`). `mask_padding`: apply the fix (True) or not.
    Raises ValueError when the teacher lacks a logprob at a valid position.
    """
    actual, top1, top1_ids = teacher
    missing = required & ~torch.isfinite(actual)
    if beta < 1:
        missing = missing | (required & ~torch.isfinite(top1))
    if bool(missing.any()):
        raise ValueError(
            f"the teacher is missing logprobs at {int(missing.sum())} of {int(required.sum())} valid completion "
            "positions; -inf is only allowed at padding (required=False)"
        )
    if mask_padding:  # the fix: the sentinel never reaches the tail bucket or the divergence
        zero = torch.zeros((), dtype=actual.dtype, device=actual.device)
        actual = torch.where(required, actual, zero)
        top1 = torch.where(required, top1, zero)

    neg_inf = torch.full((), float("-inf"), dtype=student_log_probs.dtype, device=student_log_probs.device)
    if beta == 1:
        support = completion_tokens.unsqueeze(-1)
        support_mask = torch.ones_like(support, dtype=torch.bool)
        teacher_lps = actual.unsqueeze(-1)
    else:
        support = torch.stack([top1_ids, completion_tokens], dim=-1)
        support_mask = torch.ones_like(support, dtype=torch.bool)
        support_mask[..., 1] = support[..., 1] != support[..., 0]  # a duplicate slot carries no mass
        teacher_lps = torch.stack([top1, actual], dim=-1)
        support = torch.where(support_mask, support, torch.zeros_like(support))
    teacher_nonfinite = (~torch.isfinite(teacher_lps)).sum()

    student_lps = torch.where(support_mask, student_log_probs.gather(-1, support), neg_inf)
    teacher_lps = torch.where(support_mask, teacher_lps, neg_inf)
    if add_tail:
        student_sparse, slot_mask = add_tail_bucket(student_lps, support_mask)
        teacher_sparse, _ = add_tail_bucket(teacher_lps, support_mask)
    else:
        student_sparse = student_lps - torch.logsumexp(student_lps, dim=-1, keepdim=True)
        teacher_sparse = teacher_lps - torch.logsumexp(teacher_lps, dim=-1, keepdim=True)
        slot_mask = support_mask
    jsd = jsd_divergence(student_sparse, teacher_sparse, beta, slot_mask)
    return Divergence(reduce_divergence_loss(jsd, required), jsd.detach(), teacher_nonfinite)
