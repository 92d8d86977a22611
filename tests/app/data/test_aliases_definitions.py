""""The definitions agree", checked in numbers: each aliased name's formula, written here from the framework's
source (the file named in `aliases_sources.FOREIGN_METRICS`), gives on one random batch what rldiag's
`policy_metrics` gives under the canonical key. The PipelineRL and slime names average per sequence first
(their notes say so); on a batch of equal-length sequences that is the token mean, which is what is checked."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from rldiag.app.data.aliases_sources import FOREIGN_METRICS
from rldiag.collectors import keys
from rldiag.collectors.metrics import policy_metrics

EPS_LOW, EPS_HIGH = 0.2, 0.28


def _batch(ragged: bool):
    """lp_engine (the rollout's), lp_trainer_at_rollout (same weights, a small mismatch), lp_new (after an update),
    a mask (ragged: lengths 6, 3, 5, 1) and one advantage per sequence (signs mixed)."""
    g = torch.Generator().manual_seed(7)
    lp_engine = -3.0 * torch.rand(4, 6, generator=g)
    lp_rollout = lp_engine + 0.05 * torch.randn(4, 6, generator=g)
    lp_new = lp_rollout + 0.3 * torch.randn(4, 6, generator=g)
    lengths = torch.tensor([6, 3, 5, 1]) if ragged else torch.full((4,), 6)
    mask = torch.arange(6)[None] < lengths[:, None]
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5])
    return lp_engine, lp_rollout, lp_new, mask, adv


def _ours(ragged: bool) -> dict[str, torch.Tensor]:
    lp_engine, lp_rollout, lp_new, mask, adv = _batch(ragged)
    return policy_metrics(lp_new, lp_engine, mask, eps_low=EPS_LOW, eps_high=EPS_HIGH, advantages=adv,
                          lp_trainer_at_rollout=lp_rollout)


def _theirs(ragged: bool) -> dict[str, torch.Tensor]:
    """Each framework's formula for its own key, as its source computes it (single process, one micro-batch)."""
    eng, rollout, new, mask, adv = _batch(ragged)
    a = adv[:, None].expand_as(new)
    m = mask.float()
    r = torch.exp(new - eng)  # against the engine's logprobs: the old policy rldiag's canonical keys use
    clamped = r.clamp(1 - EPS_LOW, 1 + EPS_HIGH)
    delta = (rollout - eng).abs()[mask]
    k3 = r - (new - eng) - 1
    out = {
        # TRL grpo_trainer.py: |old_per_token_logps - sampling_per_token_logps| over the mask, mean and max
        "sampling/sampling_logp_difference/mean": delta.mean(),
        "sampling/sampling_logp_difference/max": delta.max(),
        # TRL: (coef_1 < 1 - eps_low) & (A < 0) | (coef_1 > 1 + eps_high) & (A > 0), masked mean
        "clip_ratio/region_mean": (((r < 1 - EPS_LOW) & (a < 0)) | ((r > 1 + EPS_HIGH) & (a > 0))).float()[mask].mean(),
        # verl core_algos.py and slime ppo_utils.py: gt(pg_losses2, pg_losses1), pg_losses = -A * ratio
        "actor/pg_clipfrac": ((-a * clamped) > (-a * r)).float()[mask].mean(),
        "train/pg_clipfrac": ((-a * clamped) > (-a * r)).float()[mask].mean(),
        # OpenRLHF loss.py: lt(surr2, surr1), surr = ratio * A
        "train/ppo_clip_ratio": ((clamped * a) < (r * a)).float()[mask].mean(),
        # SkyRL ppo_utils.py: -surr2 > -surr1
        "policy/loss_metrics/clip_ratio": ((-(clamped * a)) > (-(r * a))).float()[mask].mean(),
        # AReaL functional.py: pg_loss1 < pg_loss2, pg_loss = -A * ratio
        "ppo_actor/update/clip_ratio/avg": ((-a * r) < (-a * clamped)).float()[mask].mean(),
        # verl debug/metrics.py: max |exp(old_log_probs) - exp(rollout_log_probs)|
        "training/rollout_probs_diff_max": (rollout.exp() - eng.exp()).abs()[mask].max(),
        # NeMo-RL loss_functions.py: masked_mean(exp(|generation_logprobs - prev_logprobs| * mask), mask)
        "train/token_mult_prob_error": (torch.exp((eng - rollout).abs() * m) * m).sum() / m.sum(),
        # prime-rl loss.py + train.py: k3 of trainer_logprobs - inference_logprobs, mean over the mask
        "mismatch_kl/all/mean": k3[mask].mean(),
        # SkyRL trainer.py: |rollout_logprobs - action_log_probs| over loss_mask > 0, mean and max
        "policy/rollout_train_logprobs_abs_diff_mean": delta.mean(),
        "policy/rollout_train_logprobs_abs_diff_max": delta.max(),
    }
    if not ragged:
        n = m.sum(-1)
        seq_mean = lambda x: ((x * m).sum(-1) / n).sum() / len(n)  # noqa: E731  sum of per-sequence means / samples
        out |= {
            # PipelineRL finetune/rl/__init__.py: sum_sum(x / num_labels_in_seq) / num_samples
            "rl/kl_new_old": seq_mean(k3),
            "rl/ratio_new_old": seq_mean(r),
            "rl/clamp_log_ratio_new_old_indicator": seq_mean((clamped != r).float()),
            # PipelineRL finetune_loop.py: ratio_new_old_sum^2 / ratio_new_old_squared_sum / num_output_tokens_sum
            "rl/ess": (r * m).sum() ** 2 / (r * r * m).sum() / m.sum(),
            # slime loss.py: sum_of_sample_mean(|old_log_probs - rollout_log_probs|), per sample
            "train/train_rollout_logprob_abs_diff": seq_mean((rollout - eng).abs()),
        }
    return out


CHECKED = sorted(set(_theirs(ragged=False)))


@pytest.mark.parametrize("key", CHECKED)
def test_the_frameworks_formula_equals_rldiags_canonical_metric(key):
    ragged = key in _theirs(ragged=True)  # token-level names on a ragged batch, per-sequence ones on equal lengths
    canonical = keys.ALIASES[key]
    assert_close(_theirs(ragged)[key], _ours(ragged)[canonical], msg=f"{key} vs {canonical}")


def test_every_alias_of_a_policy_metrics_key_is_checked_in_numbers():
    # names whose canonical key policy_metrics computes from logprobs (not entropy, reward, grad, loss, kl_ref)
    computed = set(_ours(ragged=True)) - {keys.ENTROPY}
    aliased = {m.key for m in FOREIGN_METRICS if m.canonical in computed and not m.key.startswith("train/sampling")}
    # unprefixed twins and W&B-prefixed copies of a checked name are the same formula
    twins = {"kl_new_old", "clamp_log_ratio_new_old_indicator", "ppo_clip_ratio", "train/clip_ratio/region_mean"}
    assert aliased - twins <= set(CHECKED)
