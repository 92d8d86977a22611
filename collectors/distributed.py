"""Reducing a step's gradient check and metrics across torch.distributed ranks.

Every rank calls the same collectives every step, whatever its own gradients hold, so a rank that hits
NaN cannot leave the others waiting: one SUM all-reduce carries the non-finite count (every rank then
agrees on `grad/finite` and on whether to step) with the token/sequence/sample sums and counts behind
the means; one MAX all-reduce carries the maxima. Only when some rank is non-finite do the ranks
exchange parameter names and positions (`all_gather_object`). Rank 0 writes.

Sharded gradients (FSDP2 DTensor shards, FSDP1 flat shards) ride in the same SUM all-reduce: each rank adds
its shards' squared norms, the total norm is the root of the sum (plus the replicated tensors' norm,
squared); the same SUM counts the ranks that found any gradient, so a step where none did reads unknown.

The values are reduced by key, not by position: `Monitor` sorts them by key, and a fixed-size MAX
all-reduce first compares the ranks' key sets (a CRC32 of the sorted keys, and its negation: equal on
every rank when the max of both agree). Ranks that log different keys at a step all raise
`KeyMismatchError` naming the keys (never mixed values, never a hang on collectives of different sizes).
The replicated norm rides in that same header; the maxima of max-keys, when there are any, in a second
MAX all-reduce.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from rldiag.collectors import keys
from rldiag.collectors.gradcheck import NonFinitePosition

Tensor = torch.Tensor

# Means weighted by a batch count that policy_metrics logs beside them.
WEIGHTED = {
    keys.CLIP_RATE: keys.BATCH_TOKENS,
    keys.CLIP_ACTIVE_RATE: keys.BATCH_TOKENS,
    keys.RATIO_MEAN: keys.BATCH_TOKENS,
    keys.KL_NEW_OLD: keys.BATCH_TOKENS,
    keys.KL_NEW_OLD_K1: keys.BATCH_TOKENS,
    keys.ENTROPY: keys.BATCH_TOKENS,
    keys.MISMATCH_LOGPROB_MEAN: keys.BATCH_TOKENS,
    keys.MISMATCH_TOKEN_MULT_PROB_ERROR: keys.BATCH_TOKENS,
    keys.MISMATCH_LOW_PROB_SHARE: keys.BATCH_TOKENS,
    keys.CLIP_RATE_SEQ: keys.BATCH_SEQUENCES,
    keys.RATIO_MEAN_SEQ: keys.BATCH_SEQUENCES,
    keys.REWARD_MEAN: keys.BATCH_REWARDS,
}
MAXED = {keys.RATIO_MAX, keys.RATIO_MAX_SEQ, keys.MISMATCH_LOGPROB_MAX, keys.MISMATCH_PROB_MAX}
MINNED = {keys.RATIO_MIN, keys.RATIO_MIN_SEQ}  # reduced as -max(-x), in the same MAX all-reduce
# policy/ess and policy/ess_seq are not decomposable from a rank's ESS and count: the mean over ranks
COUNTS = {keys.BATCH_TOKENS, keys.BATCH_SEQUENCES, keys.BATCH_REWARDS}


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class KeyMismatchError(ValueError):
    """Ranks logged different metric keys at one step (raised on every rank)."""


def key_fingerprint(value_keys: list[str]) -> float:
    """The low 24 bits of a CRC32 of the sorted keys: exact in float32 (MPS) as in float64."""
    return float(zlib.crc32("\0".join(sorted(value_keys)).encode()) & 0xFFFFFF)


def _key_mismatch(value_keys: list[str], step: int | None, group) -> KeyMismatchError:
    world = dist.get_world_size(group)
    bucket: list = [None] * world
    dist.all_gather_object(bucket, (dist.get_rank(group), sorted(value_keys)), group=group)
    all_keys = set().union(*(set(k) for _, k in bucket))
    lines = [f"rank {r} lacks {sorted(all_keys - set(k))}" for r, k in sorted(bucket) if all_keys - set(k)]
    at = f" at step {step}" if step is not None else ""
    return KeyMismatchError(f"rldiag: the ranks logged different metric keys{at}: {'; '.join(lines)}. Every rank "
                            "must pass the same keys to Monitor.step (log a rank-only value with Monitor.log on "
                            "rank 0, or pass it on every rank)")


@dataclass
class Reduced:
    vector: Tensor  # same layout as the input: [total_norm, per-tensor norms..., values...]
    nonfinite_ranks: Tensor  # 0-d: how many ranks hold a non-finite gradient
    per_rank: Tensor | None  # [world, len(values)] when asked for
    found_ranks: Tensor | None = None  # 0-d: how many ranks found any gradient (0: the step is unknown)


def reduce_step(vec: Tensor, n_norms: int, value_keys: list[str], *, sharded: bool = False,
                per_rank: bool = False, group=None, split: Tensor | None = None, found: bool = True,
                step: int | None = None) -> Reduced:
    """Reduce `[total_norm, norm_0.., values..]` across ranks, on the device, without a host sync.

    Token/sequence/sample means become weighted means over all ranks; std of rewards is pooled exactly
    from each rank's mean, std and count; maxima take the max, minima the min; batch counts are summed; any other
    value is averaged over ranks. The total norm is `sqrt(sum of squares)` when gradients are
    `sharded` (FSDP), else (replicated, DDP) the largest rank's, NaN if any rank's is NaN. `split`
    (`gradcheck.shard_split`: `[squares that add up across ranks, norm of the replicated rest]`) mixes
    both: the total is `sqrt(sum of the ranks' squares + the largest rank's replicated norm ** 2)`.
    `found`: this rank holds any gradient. Every rank makes the same collectives, whatever it passes.
    Ranks whose `value_keys` differ (as sets) all raise `KeyMismatchError`; the same set in another order
    is a caller's error too (pass them sorted: `Monitor` does).
    """
    world = dist.get_world_size(group)
    idx = {k: n_norms + i for i, k in enumerate(value_keys)}
    v = vec
    local_bad = (~torch.isfinite(v[1:n_norms])).any() | ~torch.isfinite(v[0])
    zero = v.new_zeros(())
    if split is not None:
        shared_sq, rest = split[0].to(v.dtype), split[1].to(v.dtype)
    elif sharded:
        shared_sq, rest = v[0] * v[0], zero
    else:
        shared_sq, rest = zero, v[0]
    found_t = torch.ones((), dtype=v.dtype, device=v.device) if found else zero
    sums = [local_bad.to(v.dtype), torch.isnan(rest).to(v.dtype), shared_sq, found_t]
    at: dict[str, int] = {}  # key -> its entry in `sums`
    how: dict[str, str] = {}
    for k in value_keys:
        x = v[idx[k]]
        if WEIGHTED.get(k) in idx:
            at[k], how[k] = len(sums), "weighted"
            sums.append(x * v[idx[WEIGHTED[k]]])
        elif k == keys.REWARD_STD and keys.BATCH_REWARDS in idx and keys.REWARD_MEAN in idx:
            n, m = v[idx[keys.BATCH_REWARDS]], v[idx[keys.REWARD_MEAN]]
            at[k], how[k] = len(sums), "pooled_std"
            sums.append((n - 1).clamp(min=0) * x * x + n * m * m)  # this rank's sum of squares
        elif k in MAXED or k in MINNED:
            how[k] = "max" if k in MAXED else "min"
        else:
            at[k], how[k] = len(sums), ("sum" if k in COUNTS else "rank_mean")
            sums.append(x)
    max_keys = [k for k in value_keys if how[k] in ("max", "min")]
    # a fixed-size header first: the key sets compared (every rank reads the same answer, so all raise
    # together) before any collective whose size depends on them
    fp = key_fingerprint(value_keys)
    header = torch.stack([v.new_tensor(fp), v.new_tensor(-fp), rest])
    dist.all_reduce(header, op=dist.ReduceOp.MAX, group=group)
    # A small host read before the step's one transfer (the device queue is drained by then either way): the
    # layout of the collectives below must be agreed first.
    top, neg_bottom = header[:2].tolist()
    if top != -neg_bottom:
        raise _key_mismatch(value_keys, step, group)
    s = torch.stack(sums)
    dist.all_reduce(s, op=dist.ReduceOp.SUM, group=group)
    mx = torch.stack([header[2]] + [v[idx[k]] if how[k] == "max" else -v[idx[k]] for k in max_keys])
    if max_keys:
        dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=group)
    gathered = None
    if per_rank:
        local = v[n_norms:].contiguous()
        chunks = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(chunks, local, group=group)
        gathered = torch.stack(chunks)

    out = v.clone()
    nan = torch.tensor(float("nan"), dtype=v.dtype, device=v.device)
    replicated = torch.where(s[1] > 0, nan, mx[0])
    # s[2] != 0 is also true for NaN; with no shard at all the replicated norm is kept exactly
    out[0] = torch.where(s[2] != 0, (s[2] + replicated * replicated).sqrt(), replicated)
    for k in value_keys:
        if how[k] == "weighted":
            out[idx[k]] = s[at[k]] / s[at[WEIGHTED[k]]].clamp(min=1)
        elif how[k] == "pooled_std":
            n = s[at[keys.BATCH_REWARDS]]
            mean = s[at[keys.REWARD_MEAN]] / n.clamp(min=1)
            out[idx[k]] = ((s[at[k]] - n * mean * mean) / (n - 1).clamp(min=1)).clamp(min=0).sqrt()
        elif how[k] == "sum":
            out[idx[k]] = s[at[k]]
        elif how[k] == "rank_mean":
            out[idx[k]] = s[at[k]] / world
    for i, k in enumerate(max_keys, start=1):
        out[idx[k]] = mx[i] if how[k] == "max" else -mx[i]
    return Reduced(out, s[0], gathered, s[3])


def gather_failure(names: list[str], positions: list[NonFinitePosition], group=None, *,
                   shared: set[str] | frozenset[str] = frozenset()
                   ) -> tuple[list[str], list[NonFinitePosition], list[int]]:
    """On a step some rank found non-finite (every rank calls this): the parameter names and positions
    of all ranks, names prefixed `rank<r>:`, positions carrying their rank; and the non-finite ranks.

    Names in `shared` (sharded parameters: every rank holds a piece of the same tensor, and under FSDP a
    NaN one rank computed reaches the other ranks' shards through the reduce-scatter) come back once,
    unprefixed, by their FQN."""
    world = dist.get_world_size(group)
    bucket: list = [None] * world
    dist.all_gather_object(bucket, (dist.get_rank(group), names, sorted(set(names) & set(shared)), positions),
                           group=group)
    all_names: list[str] = []
    all_pos: list[NonFinitePosition] = []
    ranks: list[int] = []
    seen: set[str] = set()
    for rank, n, sh, p in sorted(bucket, key=lambda t: t[0]):
        if n:
            ranks.append(rank)
        for x in n:
            if x not in sh:
                all_names.append(f"rank{rank}:{x}")
            elif x not in seen:
                seen.add(x)
                all_names.append(x)
        all_pos += [replace(x, rank=rank) for x in p]
    return all_names, all_pos, ranks
