"""Importance-sampling health against the rollout policy: ratio extremes, GSPO sequence ratios, the normalised
effective sample size, and the share of sampled tokens the engine found improbable. Definitions: DESIGN.md,
"Canonical metrics"; `policy_metrics` logs them under `keys.RATIO_*`, `keys.POLICY_ESS*`,
`keys.MISMATCH_LOW_PROB_SHARE`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from rldiag.collectors import keys
from rldiag.collectors.masked import _masked_maxes, _masked_means, _outside, _prepared, _valid, masked_mean

Tensor = torch.Tensor


def _ess(w_mean: Tensor, w2_mean: Tensor, count: Tensor) -> Tensor:
    """Normalised effective sample size `(sum w)^2 / (n sum w^2) = mean(w)^2 / mean(w^2)`, in (0, 1], from the
    masked means of `w` and `w^2`; 1.0 when nothing is valid (no evidence). The callers pass `w = exp(log w -
    max log w)`: ESS is scale-free, and so `w^2` never overflows (the largest `w` is 1)."""
    return torch.where(count > 0, w_mean * w_mean / w2_mean, torch.ones((), dtype=w_mean.dtype, device=w_mean.device))


def _ratio_extremes_ess(lr: Tensor, m: Tensor, count: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(min r, max r, ESS) over the valid tokens, 1.0 each when none, from two masked copies of the log-ratio:
    min/max are exp of the extreme log-ratios (exp is monotone), the ESS weights `exp(log r - max log r)` are 0
    at masked positions (exp(-inf)). Sums and a dot product, no stacked copy: at [64, 2048] the stacked masked
    means cost several times these passes."""
    zero, inf = lr.new_zeros(()), lr.new_full((), float("inf"))
    hi, lo = torch.where(m, lr, -inf), torch.where(m, lr, inf)
    some = count > 0
    top = torch.where(some, hi.amax(), zero) if hi.numel() else zero
    bottom = torch.where(some, lo.amin(), zero) if lo.numel() else zero
    w = hi.sub_(top).exp_().reshape(-1)
    s1, s2 = w.sum(), torch.dot(w, w)
    ess = torch.where(some, s1 * s1 / (count.clamp(min=1) * s2), lr.new_ones(()))
    return bottom.exp(), top.exp(), ess


class ImportanceStats(NamedTuple):
    """Importance-sampling health of a batch against the rollout policy (`lp_old`): token ratios `r` and
    sequence ratios `s_i` (GSPO's, the geometric mean of a row's token ratios), min/mean/max over valid
    tokens (sequences), and the normalised ESS of each (1.0 on-policy; a drop precedes collapse)."""

    ratio_min: Tensor
    ratio_mean: Tensor
    ratio_max: Tensor
    ratio_min_seq: Tensor
    ratio_mean_seq: Tensor
    ratio_max_seq: Tensor
    ess: Tensor
    ess_seq: Tensor


class _SeqStats(NamedTuple):
    clip_rate: Tensor
    min: Tensor
    mean: Tensor
    max: Tensor
    ess: Tensor
    count: Tensor


def _sequence_stats(lr: Tensor, m: Tensor, eps_low: float = 0.2, eps_high: float = 0.2) -> _SeqStats:
    """GSPO's sequence ratios `s_i = exp(mean_t log r)` over the rows with a valid token: the share outside the
    band, min/mean/max (1.0 when none) and their ESS, in one masked max and one masked sum. min and max are
    `exp` of the extreme log-ratios (exp is monotone)."""
    seq_lr = lr.sum(-1) / m.sum(-1).clamp(min=1)
    sv = m.any(-1)
    n = sv.sum()
    top, neg_bottom = _masked_maxes([seq_lr, -seq_lr], sv, [0.0, 0.0]).unbind()
    s, w = seq_lr.exp(), (seq_lr - top).exp()
    terms = [_outside(s, eps_low, eps_high), s - 1.0, w, w * w]
    out, s_mean, w1, w2 = _masked_means(terms, sv, n.clamp(min=1)).unbind()
    return _SeqStats(out, (-neg_bottom).exp(), 1.0 + s_mean, top.exp(), _ess(w1, w2, n), n)


@torch.no_grad()
def importance_stats(lp_new: Tensor, lp_old: Tensor, mask: Tensor | None = None) -> ImportanceStats:
    """Importance ratios `r = exp(lp_new - lp_old)` per token and `s_i = exp(mean_t log r)` per sequence
    (min/mean/max, 1.0 when empty) and the normalised effective sample size of each: token level
    `(sum r)^2 / (n_tokens sum r^2)` over the batch's valid tokens, sequence level the same over the `s_i`
    of the rows with a valid token. `[B, T]` logprobs (the sequence level needs rows)."""
    m, lr, r = _prepared(lp_new, lp_old, mask, rows=True)
    count = m.sum()
    rmin, rmax, ess = _ratio_extremes_ess(lr, m, count)
    seq = _sequence_stats(lr, m)
    return ImportanceStats(rmin, 1.0 + masked_mean(r - 1.0, m), rmax, seq.min, seq.mean, seq.max, ess, seq.ess)


def _below(lp_engine: Tensor, threshold: float) -> Tensor:
    return (lp_engine.float() < math.log(threshold)).float()


@torch.no_grad()
def low_prob_share(lp_engine: Tensor, mask: Tensor | None = None, *,
                   threshold: float = keys.LOW_PROB_THRESHOLD) -> Tensor:
    """Fraction of valid sampled tokens to which the engine gave probability under `threshold`
    (`exp(lp_engine) < threshold`): where train-inference mismatch concentrates. 0 for an empty batch."""
    m = _valid(mask, lp_engine)
    return masked_mean(_below(lp_engine, threshold), m)
