"""Per-step RL diagnostics as pure torch functions (no I/O, no host synchronisation).

Shapes: token tensors are `[B, T]` (batch, completion position); logits are `[B, T, V]`; `mask` is
`[B, T]` (bool or 0/1) marking valid completion tokens, `None` meaning every position is valid.
Every function returns detached 0-d tensors on the input's device; `to_host` moves a whole step's
values to the host in one transfer.

Masked positions are replaced (`torch.where`) before any arithmetic, never multiplied by zero, so a
`-inf` sentinel at padding cannot turn into NaN (`-inf * 0` and `-inf - -inf` are NaN). Masked means
divide by `mask.sum().clamp(min=1)`: an empty batch gives 0 (1.0 for the ratio statistics). The masked
reductions live in `masked.py`, the importance-sampling health in `importance.py` (both re-exported here).
Definitions: DESIGN.md, "Canonical metrics".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch

from rldiag.collectors import keys
from rldiag.collectors.chunks import Workspace, cache_budget, row_chunks
from rldiag.collectors.compat.torch import host_dtype
from rldiag.collectors.importance import ImportanceStats as ImportanceStats  # re-exported
from rldiag.collectors.importance import _below, _ratio_extremes_ess, _sequence_stats
from rldiag.collectors.importance import importance_stats as importance_stats  # re-exported
from rldiag.collectors.importance import low_prob_share as low_prob_share  # re-exported
from rldiag.collectors.masked import (  # masked_mean, masked_max and _valid are imported from here too
    _masked_maxes,
    _masked_means,
    _outside,
    _prepared,
    _valid,
    masked_max,
    masked_mean,
)

Tensor = torch.Tensor


@torch.no_grad()
def clip_rate(
    lp_new: Tensor, lp_old: Tensor, mask: Tensor | None = None, *, eps_low: float = 0.2, eps_high: float = 0.2
) -> Tensor:
    """Fraction of valid tokens whose ratio `r = exp(lp_new - lp_old)` lies outside `[1-eps_low, 1+eps_high]`.

    PipelineRL's `clamp_log_ratio_new_old_indicator`. Not TRL's `clip_ratio/region_mean`, which counts
    only the tokens where the clip binds (`clip_active_rate`).
    """
    m, _, r = _prepared(lp_new, lp_old, mask)
    return masked_mean(_outside(r, eps_low, eps_high), m)


def _active(r: Tensor, advantages: Tensor, eps_low: float, eps_high: float) -> Tensor:
    if tuple(advantages.shape) not in (tuple(r.shape), tuple(r.shape[:1]), (*r.shape[:1], 1)):
        raise ValueError(
            f"advantages have shape {tuple(advantages.shape)} but the logprobs {tuple(r.shape)}; pass one per "
            f"sequence ({tuple(r.shape[:1])}) or one per token ({tuple(r.shape)})"
        )
    adv = advantages if advantages.dim() == r.dim() else advantages.reshape(*advantages.shape, *[1] * (r.dim() - advantages.dim()))
    return ((adv > 0) & (r > 1 + eps_high)) | ((adv < 0) & (r < 1 - eps_low))


@torch.no_grad()
def clip_active_rate(
    lp_new: Tensor, lp_old: Tensor, advantages: Tensor, mask: Tensor | None = None, *, eps_low: float = 0.2,
    eps_high: float = 0.2,
) -> Tensor:
    """Fraction of valid tokens where the clipped branch of the PPO/GRPO objective is active: the ratio
    is above `1+eps_high` with a positive advantage, or below `1-eps_low` with a negative one (there the
    clipped term is the minimum and the token's gradient is zero).

    `advantages`: `[B]` (one per sequence, as GRPO) or `[B, T]`. TRL's `clip_ratio/region_mean`, verl's
    `actor/pg_clipfrac`, OpenRLHF's `ppo_clip_ratio`. About half of `clip_rate` when advantage signs are
    independent of the ratio.
    """
    m, _, r = _prepared(lp_new, lp_old, mask)
    return masked_mean(_active(r, advantages.to(r.device), eps_low, eps_high), m)


def _sequence_ratio(lr: Tensor, m: Tensor) -> Tensor:
    return (lr.sum(-1) / m.sum(-1).clamp(min=1)).exp()


@torch.no_grad()
def sequence_ratio(lp_new: Tensor, lp_old: Tensor, mask: Tensor | None = None) -> Tensor:
    """GSPO's per-sequence ratio `s_i = exp(mean_t(lp_new - lp_old))` over each row's valid tokens, `[B]`.

    A row without valid tokens gets 1.0.
    """
    m, lr, _ = _prepared(lp_new, lp_old, mask)
    return _sequence_ratio(lr, m)


@torch.no_grad()
def sequence_clip_rate(
    lp_new: Tensor, lp_old: Tensor, mask: Tensor | None = None, *, eps_low: float = 0.2, eps_high: float = 0.2
) -> Tensor:
    """Fraction of sequences (with at least one valid token) whose GSPO sequence ratio is outside the band."""
    m, lr, _ = _prepared(lp_new, lp_old, mask, rows=True)
    return masked_mean(_outside(_sequence_ratio(lr, m), eps_low, eps_high), m.any(-1))


class RatioStats(NamedTuple):
    mean: Tensor
    max: Tensor


def _ratio_stats(r: Tensor, m: Tensor) -> RatioStats:
    return RatioStats(1.0 + masked_mean(r - 1.0, m), masked_max(r, m, empty=1.0))


@torch.no_grad()
def ratio_stats(lp_new: Tensor, lp_old: Tensor, mask: Tensor | None = None) -> RatioStats:
    """Masked mean and max of the token ratio `r`; both 1.0 for an empty batch (no evidence of drift)."""
    m, _, r = _prepared(lp_new, lp_old, mask)
    return _ratio_stats(r, m)


class KLStats(NamedTuple):
    k3: Tensor
    k1: Tensor


def _kl_terms(lr: Tensor, r: Tensor) -> tuple[Tensor, Tensor]:
    """Per-token k3 `(r - 1) - log r` and k1 `-log r` (zero at masked positions, where `lr` is 0)."""
    return r - 1.0 - lr, -lr


def _kl(lr: Tensor, r: Tensor, m: Tensor) -> KLStats:
    return KLStats(*_masked_means(list(_kl_terms(lr, r)), m, m.sum().clamp(min=1)).unbind())


@torch.no_grad()
def kl_new_old(lp_new: Tensor, lp_old: Tensor, mask: Tensor | None = None) -> KLStats:
    """KL between rollout and current policy from sampled tokens (Schulman's estimators).

    k3 = masked mean of `(r - 1) - log r` (non-negative, low variance); k1 = masked mean of
    `lp_old - lp_new`.
    """
    m, lr, r = _prepared(lp_new, lp_old, mask)
    return _kl(lr, r, m)


_F32_LOWEST = torch.finfo(torch.float32).min


def _entropy_rows(x: Tensor, ws: Workspace) -> Tensor:
    # H = log s - sum_v p_v d_v with d = x - max(x), s = sum_v exp(d_v), p = softmax(x). 1/s is p's largest
    # entry (exp(0) / s), so no second exp pass is needed: softmax's own is vectorised, while entr(p) (a log
    # per element) cost 3x the rest (measured on 8 x 128 x 512 float32, one thread). Both terms are >= 0: no
    # cancellation. Float32 buffers reused by every chunk.
    x32 = x if x.dtype == torch.float32 else ws.get("x", x.shape).copy_(x)
    p = torch.softmax(x32, dim=-1, out=ws.get("p", x.shape))
    d = torch.sub(x32, x32.amax(-1, keepdim=True), out=ws.get("d", x.shape))
    d.clamp_(min=_F32_LOWEST)  # a -inf logit has p = 0: 0 * lowest is 0 where 0 * -inf is NaN; NaN stays NaN
    return torch.linalg.vecdot(p, d).neg_().sub_(p.amax(-1).log_())


@torch.no_grad()
def token_entropy(logits: Tensor) -> Tensor:
    """Per-position entropy of `softmax(logits)`, `[..., V]` -> `[...]` float32 (NaN where every logit
    is `-inf`). Walks the rows in chunks (collectors/chunks.py): never a float32 copy of all the logits."""
    if logits.dim() < 1:
        raise ValueError("logits must be [..., V]; got a 0-d tensor")
    h = torch.empty(logits.shape[:-1], dtype=torch.float32, device=logits.device)
    ws = Workspace(logits.device)
    budget = max(cache_budget(logits.device), logits.shape[-1])  # whole rows: [n, V] chunks, never 1-d ones
    for idx, rows in row_chunks(logits, budget):
        h[idx] = _entropy_rows(rows, ws)
    return h


@torch.no_grad()
def entropy_from_logits(logits: Tensor, mask: Tensor | None = None) -> Tensor:
    """Masked mean token entropy `H = -sum_v p_v log p_v` of `softmax(logits)`, computed in float32.

    Logits of `-inf` (masked vocabulary) contribute 0; positions that are all `-inf` must be masked.
    """
    h = token_entropy(logits)
    if mask is None:
        mask = ~torch.isnan(h)  # a position whose logits are all -inf has no distribution
    return masked_mean(h, _valid(mask, h))


class RewardStats(NamedTuple):
    mean: Tensor
    std: Tensor


@torch.no_grad()
def reward_stats(rewards: Tensor) -> RewardStats:
    """Mean and sample standard deviation (n-1) of the batch's completion rewards; std 0 for one reward.

    Non-finite rewards propagate on purpose: a NaN reward is a bug to see.
    """
    r = rewards.detach().float().reshape(-1)
    if r.numel() < 2:  # the count is known on the host: no device sync to branch on it
        mean = r.sum() if r.numel() else r.new_zeros(())
        return RewardStats(mean, torch.where(torch.isfinite(mean), 0.0, mean))
    std, mean = torch.std_mean(r, correction=1)
    return RewardStats(mean, std)


class MismatchStats(NamedTuple):
    logprob_abs_diff_mean: Tensor
    logprob_abs_diff_max: Tensor
    prob_abs_diff_max: Tensor


@torch.no_grad()
def logprob_mismatch(lp_trainer: Tensor, lp_engine: Tensor, mask: Tensor | None = None) -> MismatchStats:
    """Train-inference mismatch at the same weights: `|lp_trainer - lp_engine|` mean and max (log space)
    and max of `|exp(lp_trainer) - exp(lp_engine)|` (probability space; verl's `rollout_probs_diff_max`).
    """
    m = _valid(mask, lp_trainer)
    d, dp = _mismatch_terms(lp_trainer, lp_engine, m)
    return MismatchStats(masked_mean(d, m), *_masked_maxes([d, dp], m, [0.0, 0.0]).unbind())


def _mismatch_terms(lp_trainer: Tensor, lp_engine: Tensor, m: Tensor) -> tuple[Tensor, Tensor]:
    """Per-token `|lp_trainer - lp_engine|` and `|exp(lp_trainer) - exp(lp_engine)|`, 0 at masked positions."""
    zero = torch.zeros((), dtype=torch.float32, device=lp_trainer.device)
    a = torch.where(m, lp_trainer.float(), zero)
    b = torch.where(m, lp_engine.float(), zero)
    return (a - b).abs(), (a.exp() - b.exp()).abs()


@torch.no_grad()
def token_mult_prob_error(lp_trainer: Tensor, lp_engine: Tensor, mask: Tensor | None = None) -> Tensor:
    """NeMo-RL's `token_mult_prob_error`: masked mean of `exp(|lp_trainer - lp_engine|)` (1.0 at parity),
    with `lp_trainer` the trainer's logprobs at the rollout weights (NeMo-RL's `prev_logprobs`)."""
    # NVIDIA-NeMo/RL nemo_rl/algorithms/loss/loss_functions.py (ClippedPGLossFn.__call__): lp_error =
    # abs(generation_logprobs - prev_logprobs); masked_mean(exp(lp_error * mask), mask) over the valid tokens
    m = _valid(mask, lp_trainer)
    zero = torch.zeros((), dtype=torch.float32, device=lp_trainer.device)
    d = torch.where(m, lp_trainer.float() - lp_engine.float(), zero).abs()
    return 1.0 + masked_mean(d.exp() - 1.0, m)


class WorstTokens(NamedTuple):
    """The `k` valid tokens with the largest `|lp_trainer - lp_engine|`, largest first, each `[k]`.

    `sample`/`position`: row and completion position (-1 where fewer than `k` tokens are valid; the
    values are then 0);
    `token_id`: the sampled token (-1 without `token_ids`); `abs_diff` NaN/inf sort first (a NaN is worst).
    """

    sample: Tensor
    position: Tensor
    token_id: Tensor
    lp_trainer: Tensor
    lp_engine: Tensor
    abs_diff: Tensor


@torch.no_grad()
def worst_tokens(lp_trainer: Tensor, lp_engine: Tensor, mask: Tensor | None = None, *,
                 token_ids: Tensor | None = None, k: int = 1) -> WorstTokens:
    """Where the trainer and the engine disagree most, found on the device (no host synchronisation)."""
    if lp_trainer.dim() not in (1, 2):
        raise ValueError(f"worst_tokens needs [B, T] (or [T]) logprobs; got shape {tuple(lp_trainer.shape)}")
    m = _valid(mask, lp_trainer)
    if lp_trainer.dim() == 1:  # one sample
        lp_trainer, lp_engine, m = lp_trainer[None], lp_engine[None], m[None]
        token_ids = None if token_ids is None else token_ids[None]
    t = max(lp_trainer.shape[-1], 1)
    a, b = lp_trainer.float(), lp_engine.float()
    d = (a - b).abs()
    # NaN first (it is the worst disagreement), masked positions last: rank key +inf / -1 there
    key = torch.where(m, d.nan_to_num(nan=float("inf"), posinf=float("inf")), -1.0).reshape(-1)
    k_eff = min(k, key.numel())
    top = key.topk(k_eff).indices
    valid = m.reshape(-1)[top]
    if k_eff < k:  # fewer tokens than asked for: the rest are "none"
        top = torch.cat([top, top.new_zeros(k - k_eff)])
        valid = torch.cat([valid, valid.new_zeros(k - k_eff)])
    # every value at the chosen positions in one gather; 0 (not NaN) where none: an empty step must not
    # look non-finite; -1 for where
    vals = torch.where(valid, torch.stack([a, b, d]).reshape(3, -1)[:, top] if key.numel() else 0.0, 0.0)
    ids = token_ids.reshape(-1)[top].long() if token_ids is not None and key.numel() else top.new_full((k,), -1)
    where = torch.where(valid, torch.stack([top // t, top % t, ids]), -1)
    return WorstTokens(sample=where[0], position=where[1], token_id=where[2], lp_trainer=vals[0],
                       lp_engine=vals[1], abs_diff=vals[2])


@torch.no_grad()
def policy_metrics(
    lp_new: Tensor,
    lp_old: Tensor,
    mask: Tensor | None = None,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    logits: Tensor | None = None,
    rewards: Tensor | None = None,
    lp_trainer_at_rollout: Tensor | None = None,
    advantages: Tensor | None = None,
    token_ids: Tensor | None = None,
) -> dict[str, Tensor]:
    """Every canonical policy metric that the given tensors allow, as `{key: 0-d tensor}`, with the
    batch sizes behind them (`batch/valid_tokens`, `batch/sequences`, `batch/rewards`: the weights
    that reduce the means across ranks).

    `advantages` (`[B]` or `[B, T]`) add `policy/clip_active_rate` beside `policy/clip_rate`.
    `lp_trainer_at_rollout`: the trainer's logprobs at the rollout weights (before any update) for the
    mismatch metrics against `lp_old` (the engine's). On the first minibatch of an on-policy step that
    is `lp_new` itself. With it, the step's worst token (`mismatch/worst/*`: sample, position, both
    logprobs, and the token id when `token_ids` `[B, T]` are given) rides in the same transfer, with
    NeMo-RL's `mismatch/token_mult_prob_error`.

    Importance-sampling health against the rollout policy (`lp_old`), always: `policy/ratio_min` beside
    the mean and max, the sequence ratios' `policy/ratio_{min,mean,max}_seq`, the normalised effective
    sample sizes `policy/ess` (token ratios) and `policy/ess_seq` (sequence ratios) as `importance_stats`
    defines them, and `mismatch/low_prob_share` (`low_prob_share` of `lp_old`).
    """
    m, lr, r = _prepared(lp_new, lp_old, mask, rows=True)  # once, for every ratio-based metric
    count = m.sum()
    # Every token-level mean in one masked sum and every max in one masked max: the few dozen tiny ops
    # these metrics are one at a time cost more in dispatch than in arithmetic (bench.overhead).
    means: dict[str, Tensor] = {keys.CLIP_RATE: _outside(r, eps_low, eps_high), keys.RATIO_MEAN: r - 1.0,
                                keys.MISMATCH_LOW_PROB_SHARE: _below(lp_old, keys.LOW_PROB_THRESHOLD)}
    means.update(zip((keys.KL_NEW_OLD, keys.KL_NEW_OLD_K1), _kl_terms(lr, r)))
    maxes: dict[str, tuple[Tensor, float]] = {}
    if advantages is not None:
        means[keys.CLIP_ACTIVE_RATE] = _active(r, advantages.to(r.device), eps_low, eps_high).float()
    if logits is not None:
        if tuple(logits.shape[:-1]) != tuple(lp_new.shape):
            raise ValueError(
                f"logits have shape {tuple(logits.shape)} but the logprobs {tuple(lp_new.shape)}; pass the logits "
                f"that scored the completion tokens, [{', '.join(map(str, lp_new.shape))}, vocab]"
            )
        h = token_entropy(logits)
        means[keys.ENTROPY] = h
    mm = _mismatch_terms(lp_trainer_at_rollout, lp_old, m) if lp_trainer_at_rollout is not None else None
    if mm is not None:
        means[keys.MISMATCH_LOGPROB_MEAN] = mm[0]
        means[keys.MISMATCH_TOKEN_MULT_PROB_ERROR] = mm[0].exp() - 1.0  # 0 at masked positions, where |d| is 0
        maxes[keys.MISMATCH_LOGPROB_MAX], maxes[keys.MISMATCH_PROB_MAX] = (mm[0], 0.0), (mm[1], 0.0)
    mean_v = _masked_means(list(means.values()), m, count.clamp(min=1)).unbind()
    max_v = _masked_maxes([x for x, _ in maxes.values()], m, [e for _, e in maxes.values()]).unbind() if maxes else ()
    got = dict(zip(means, mean_v)) | dict(zip(maxes, max_v))
    got[keys.RATIO_MEAN] = 1.0 + got[keys.RATIO_MEAN]
    got[keys.RATIO_MIN], got[keys.RATIO_MAX], ess = _ratio_extremes_ess(lr, m, count)
    seq = _sequence_stats(lr, m, eps_low, eps_high)
    out: dict[str, Tensor] = {
        keys.BATCH_TOKENS: count.float(),
        keys.BATCH_SEQUENCES: seq.count.float(),
        keys.CLIP_RATE: got[keys.CLIP_RATE],
        keys.CLIP_RATE_SEQ: seq.clip_rate,
        keys.RATIO_MIN_SEQ: seq.min, keys.RATIO_MEAN_SEQ: seq.mean, keys.RATIO_MAX_SEQ: seq.max,
        keys.POLICY_ESS: ess, keys.POLICY_ESS_SEQ: seq.ess,
    }
    for key in (keys.CLIP_ACTIVE_RATE, keys.RATIO_MEAN, keys.RATIO_MAX, keys.RATIO_MIN, keys.KL_NEW_OLD,
                keys.KL_NEW_OLD_K1, keys.ENTROPY, keys.MISMATCH_LOW_PROB_SHARE):
        if key in got:
            out[key] = got[key]
    if rewards is not None:
        rw = reward_stats(rewards)
        out[keys.REWARD_MEAN], out[keys.REWARD_STD] = rw.mean, rw.std
        out[keys.BATCH_REWARDS] = rewards.new_full((), float(rewards.numel()), dtype=torch.float32)
    if mm is not None:
        got[keys.MISMATCH_TOKEN_MULT_PROB_ERROR] = 1.0 + got[keys.MISMATCH_TOKEN_MULT_PROB_ERROR]
        for key in (keys.MISMATCH_LOGPROB_MEAN, keys.MISMATCH_LOGPROB_MAX, keys.MISMATCH_PROB_MAX,
                    keys.MISMATCH_TOKEN_MULT_PROB_ERROR):
            out[key] = got[key]
    if lp_trainer_at_rollout is not None and lp_old.dim() <= 2:
        w = worst_tokens(lp_trainer_at_rollout, lp_old, m, token_ids=token_ids, k=1)
        out[keys.WORST_SAMPLE], out[keys.WORST_POSITION] = w.sample[0].float(), w.position[0].float()
        out[keys.WORST_TOKEN_ID] = w.token_id[0].float()
        out[keys.WORST_LP_TRAINER], out[keys.WORST_LP_ENGINE] = w.lp_trainer[0], w.lp_engine[0]
    return out


def pack(values: Mapping[str, Tensor | float | int], *, device: torch.device | str | None = None) -> Tensor:
    """All of a step's values, in order, as one 1-d float64 tensor (float32 on MPS) on `device`
    (default: the first tensor's). Nothing crosses to the host."""
    if device is None:
        device = next((v.device for v in values.values() if isinstance(v, torch.Tensor)), torch.device("cpu"))
    device = torch.device(device)
    dtype = host_dtype(device)
    vs = list(values.values())
    if vs and all(isinstance(v, Tensor) and v.dim() == 0 and v.dtype == vs[0].dtype and v.device == device
                  for v in vs):  # the usual step (0-d metrics of one dtype): one stack, not a copy per value
        with torch.no_grad():
            return torch.stack(vs).to(dtype)
    parts = []
    for k, v in values.items():
        if isinstance(v, torch.Tensor):
            if v.numel() != 1:
                raise ValueError(
                    f"metric {k!r} is a tensor of shape {tuple(v.shape)}; log a scalar (0-d or one element), "
                    "e.g. reduce it with .mean() first"
                )
            parts.append(v.detach().reshape(1).to(device, dtype))
        else:
            try:
                parts.append(torch.tensor([float(v)], dtype=dtype, device=device))
            except (TypeError, ValueError):
                raise ValueError(f"metric {k!r} has value {v!r} ({type(v).__name__}); log a number") from None
    return torch.cat(parts) if parts else torch.zeros(0, dtype=dtype, device=device)


def to_host(values: Mapping[str, Tensor | float | int]) -> dict[str, float]:
    """Python floats for a step's values, with every tensor crossing to the host in one transfer."""
    return dict(zip(values.keys(), pack(values).tolist()))
