"""Canonical metric keys, run-metadata names and the alias table: defined once, used by both sides.

The definitions are in DESIGN.md ("Canonical metrics"). `rldiag.app` imports these constants; nothing
else spells a canonical key as a string literal. Keys that only an experiment logs live in that experiment.
"""

from __future__ import annotations

# --- policy (trainer vs rollout policy) -------------------------------------------------------
CLIP_RATE = "policy/clip_rate"
# tokens where the clipped branch of the PPO/GRPO objective is active (outside the band on the side the
# advantage's sign makes binding): about half of CLIP_RATE on a random batch, so never aliased to it
CLIP_ACTIVE_RATE = "policy/clip_active_rate"
CLIP_RATE_SEQ = "policy/clip_rate_seq"
RATIO_MEAN = "policy/ratio_mean"
RATIO_MAX = "policy/ratio_max"
RATIO_MIN = "policy/ratio_min"
# Importance-sampling health against the rollout policy (lp_old, the engine's). The sequence ratio is GSPO's
# s_i = exp(mean_t(lp_new - lp_old)), the geometric mean of a sequence's token ratios; ESS is normalised,
# (sum w)^2 / (n sum w^2) in (0, 1], of the token ratios (POLICY_ESS) or of the sequence ratios (_SEQ).
RATIO_MIN_SEQ = "policy/ratio_min_seq"
RATIO_MEAN_SEQ = "policy/ratio_mean_seq"
RATIO_MAX_SEQ = "policy/ratio_max_seq"
POLICY_ESS = "policy/ess"
POLICY_ESS_SEQ = "policy/ess_seq"
KL_NEW_OLD = "policy/kl_new_old"
KL_NEW_OLD_K1 = "policy/kl_new_old_k1"
# KL to a frozen reference model as the trainer computes it (TRL `kl`, the beta term): not new/old
KL_REF = "policy/kl_ref"
ENTROPY = "policy/entropy"

# --- reward ------------------------------------------------------------------------------------
REWARD_MEAN = "reward/mean"
REWARD_STD = "reward/std"

# --- train-inference mismatch (same weights, trainer vs engine) --------------------------------
MISMATCH_LOGPROB_MEAN = "mismatch/logprob_abs_diff_mean"
MISMATCH_LOGPROB_MAX = "mismatch/logprob_abs_diff_max"
MISMATCH_PROB_MAX = "mismatch/prob_abs_diff_max"
# NeMo-RL's token_mult_prob_error (masked mean of exp|lp_trainer - lp_engine|, 1.0 at parity) and the share of
# valid sampled tokens the engine gave probability under LOW_PROB_THRESHOLD (metrics.py has the definitions)
MISMATCH_TOKEN_MULT_PROB_ERROR = "mismatch/token_mult_prob_error"
MISMATCH_LOW_PROB_SHARE = "mismatch/low_prob_share"
LOW_PROB_THRESHOLD = 1e-3
# The step's worst token (largest |lp_trainer - lp_engine|): where to look, not curves to chart, so not in
# CANONICAL_METRICS. sample/position/token_id are -1 when the step had no valid token (token_id also
# when the trainer passed no token ids).
WORST_SAMPLE = "mismatch/worst/sample"
WORST_POSITION = "mismatch/worst/position"
WORST_TOKEN_ID = "mismatch/worst/token_id"
WORST_LP_TRAINER = "mismatch/worst/lp_trainer"
WORST_LP_ENGINE = "mismatch/worst/lp_engine"
WORST_TOKEN_KEYS: tuple[str, ...] = (WORST_SAMPLE, WORST_POSITION, WORST_TOKEN_ID, WORST_LP_TRAINER, WORST_LP_ENGINE)

# --- gradients -----------------------------------------------------------------------------------
GRAD_NORM = "grad/norm"
GRAD_FINITE = "grad/finite"
GRAD_NONFINITE_PARAMS = "grad/nonfinite_params"
# 0 at a step where no parameter held a gradient (DeepSpeed ZeRO keeps its partitions out of `.grad`; a
# check after `zero_grad`): nothing was checked, so GRAD_NORM, GRAD_FINITE and GRAD_NONFINITE_PARAMS are
# not logged at that step (unknown is neither finite nor NaN). Never logged at a checked step. Not canonical:
# nothing to chart.
GRAD_FOUND = "grad/found"
# fp16 loss scaling (torch.amp.GradScaler): the scale of the step's gradients (GRAD_NORM is logged unscaled),
# and 1.0 at a step whose scaled gradients overflowed: the scaler skips it and halves its scale, so that step
# logs no GRAD_FINITE and raises no NaN alert (collectors/amp.py says when it is a real NaN). Not canonical.
GRAD_LOSS_SCALE = "grad/loss_scale"
GRAD_SCALER_OVERFLOW = "grad/scaler_overflow"
# On a non-finite (NaN/inf, not scaler-overflow) step: 1 when the weights did not change (policy "skip": rldiag
# zeroed the gradients and skipped the optimizer, or the loss scaler skipped it), 0 when the optimizer stepped
# on it. Logged on those steps only (collectors/nonfinite.py). Not canonical.
GRAD_SKIPPED = "grad/skipped"
# The run param naming the non-finite policy in force (warn / skip / raise), logged by Monitor and the callback.
PARAM_NONFINITE_POLICY = "rldiag.nonfinite_policy"

LOSS = "loss"
# The unfiltered loss where rldiag logs into a trainer's own run (transformers' MLflowCallback): that run's
# LOSS is the trainer's, cleaned of NaN/inf by logging_nan_inf_filter. Never aliased to LOSS (the canonical,
# filtered one would win); the read side checks both for a non-finite loss. Not canonical.
LOSS_UNFILTERED = "rldiag/loss"

# --- batch sizes (the weights that reduce token/sequence means across ranks) -----------------------
BATCH_TOKENS = "batch/valid_tokens"
BATCH_SEQUENCES = "batch/sequences"
BATCH_REWARDS = "batch/rewards"
# TRL's GRPOTrainer: the fraction of completions cut at max_completion_length. Under its param
# mask_truncated_completions=True those completions are masked out of the loss, so a step at 1.0 has no
# valid token at all (read side: nan_events.truncated_masked_steps). Not canonical: TRL's own name.
TRL_CLIPPED_RATIO = "completions/clipped_ratio"
TRL_MASK_TRUNCATED = "mask_truncated_completions"

CANONICAL_METRICS: tuple[str, ...] = (
    CLIP_RATE,
    CLIP_ACTIVE_RATE,
    CLIP_RATE_SEQ,
    RATIO_MEAN,
    RATIO_MAX,
    RATIO_MIN,
    RATIO_MEAN_SEQ,
    RATIO_MIN_SEQ,
    RATIO_MAX_SEQ,
    POLICY_ESS,
    POLICY_ESS_SEQ,
    KL_NEW_OLD,
    KL_NEW_OLD_K1,
    KL_REF,
    ENTROPY,
    REWARD_MEAN,
    REWARD_STD,
    MISMATCH_LOGPROB_MEAN,
    MISMATCH_LOGPROB_MAX,
    MISMATCH_PROB_MAX,
    MISMATCH_TOKEN_MULT_PROB_ERROR,
    MISMATCH_LOW_PROB_SHARE,
    GRAD_NORM,
    GRAD_FINITE,
    GRAD_NONFINITE_PARAMS,
    LOSS,
    BATCH_TOKENS,
    BATCH_SEQUENCES,
    BATCH_REWARDS,
)

# Foreign metric names (what other trainers log) -> canonical key. The read side maps these so that
# a run logged by TRL/transformers, PipelineRL or verl shows up on the same panels.
ALIASES: dict[str, str] = {
    # transformers / TRL
    "grad_norm": GRAD_NORM,
    "kl": KL_REF,  # TRL: KL(policy || reference model), logged when beta != 0
    "entropy": ENTROPY,
    "clip_ratio/region_mean": CLIP_ACTIVE_RATE,  # see ALIAS_NOTES
    "reward": REWARD_MEAN,
    "reward_std": REWARD_STD,
    "train/grad_norm": GRAD_NORM,
    "train/loss": LOSS,
    # PipelineRL
    "kl_new_old": KL_NEW_OLD,
    "clamp_log_ratio_new_old_indicator": CLIP_RATE,
    # verl
    "actor/pg_clipfrac": CLIP_ACTIVE_RATE,
    "actor/entropy": ENTROPY,
    "actor/grad_norm": GRAD_NORM,
    "training/rollout_probs_diff_max": MISMATCH_PROB_MAX,
    "critic/score/mean": REWARD_MEAN,
    # OpenRLHF
    "ppo_clip_ratio": CLIP_ACTIVE_RATE,
    # Every framework's names, each read in its own source: app/data/aliases_sources.py says where and how
    # (a test pins that table and this one together). TRL, then TRL under W&B/TensorBoard (train/ prefix)
    "sampling/sampling_logp_difference/mean": MISMATCH_LOGPROB_MEAN,
    "sampling/sampling_logp_difference/max": MISMATCH_LOGPROB_MAX,
    "train/sampling/sampling_logp_difference/mean": MISMATCH_LOGPROB_MEAN,
    "train/sampling/sampling_logp_difference/max": MISMATCH_LOGPROB_MAX,
    "train/clip_ratio/region_mean": CLIP_ACTIVE_RATE,
    "train/kl": KL_REF,
    "train/entropy": ENTROPY,
    "train/reward": REWARD_MEAN,
    "train/reward_std": REWARD_STD,
    # NeMo-RL
    "train/token_mult_prob_error": MISMATCH_TOKEN_MULT_PROB_ERROR,
    # slime
    "train/train_rollout_logprob_abs_diff": MISMATCH_LOGPROB_MEAN,
    "train/pg_clipfrac": CLIP_ACTIVE_RATE,
    # prime-rl
    "mismatch_kl/all/mean": KL_NEW_OLD,
    "entropy/all/mean": ENTROPY,
    "optim/grad_norm": GRAD_NORM,
    # OpenRLHF (its W&B/TensorBoard logger prefixes train/)
    "train/ppo_clip_ratio": CLIP_ACTIVE_RATE,
    # SkyRL
    "policy/rollout_train_logprobs_abs_diff_mean": MISMATCH_LOGPROB_MEAN,
    "policy/rollout_train_logprobs_abs_diff_max": MISMATCH_LOGPROB_MAX,
    "policy/loss_metrics/clip_ratio": CLIP_ACTIVE_RATE,
    "policy/policy_entropy": ENTROPY,
    # AReaL
    "ppo_actor/update/clip_ratio/avg": CLIP_ACTIVE_RATE,
    "ppo_actor/update/entropy/avg": ENTROPY,
    # ROLL
    "actor_train/grad_norm": GRAD_NORM,
    # PipelineRL as it logs them (rl/ prefix)
    "rl/kl_new_old": KL_NEW_OLD,
    "rl/clamp_log_ratio_new_old_indicator": CLIP_RATE,
    "rl/ratio_new_old": RATIO_MEAN,
    "rl/ess": POLICY_ESS,
    "rl/entropy": ENTROPY,
}

# Where an aliased name's definition differs from the canonical key's in aggregation or scaling: the
# dashboard and the report show these notes beside the metric. A name with a different *definition*
# (e.g. TRL's `clip_ratio/region_mean`, active clipping, vs `policy/clip_rate`, every token outside the
# band) is aliased to the key that matches it, never to a near one.
ALIAS_NOTES: dict[str, str] = {
    "clip_ratio/region_mean": "TRL: per token, or per sequence under GSPO (importance_sampling_level='sequence')",
    "entropy": "TRL: entropy of the temperature-scaled distribution (logits / temperature)",
    "kl": "TRL: KL to the reference model (k3), logged only when beta != 0",
    "actor/pg_clipfrac": "verl: token mean over the micro-batch, then averaged over micro-batches",
    "sampling/sampling_logp_difference/mean": "TRL: token mean per process, then averaged over processes",
    "train/train_rollout_logprob_abs_diff": "slime: per-sample token means (sample-level aggregation)",
    "train/pg_clipfrac": "slime: per-sample token means (sample-level aggregation)",
    "rl/kl_new_old": "PipelineRL: per-sequence token means, averaged over sequences",
    "rl/ratio_new_old": "PipelineRL: per-sequence token means, averaged over sequences",
    "rl/clamp_log_ratio_new_old_indicator": "PipelineRL: per-sequence token means, averaged over sequences",
    "train/sampling/sampling_logp_difference/mean": "TRL: token mean per process, then averaged over processes",
    "entropy/all/mean": "prime-rl: entropy of the temperature-scaled logits",
    "policy/loss_metrics/clip_ratio": "SkyRL: token mean per micro-batch, averaged over micro-batches",
    "policy/policy_entropy": "SkyRL: token mean per micro-batch, averaged over micro-batches",
    "train/ppo_clip_ratio": "OpenRLHF: the ratio against the actor's recomputed old logprobs, not the engine's",
    "ppo_clip_ratio": "OpenRLHF: the ratio against the actor's recomputed old logprobs, not the engine's",
    "ppo_actor/update/clip_ratio/avg": "AReaL: the ratio against the proximal policy, not the engine's",
    "rl/entropy": "PipelineRL: per-sequence token means, averaged over sequences",
}


def canonical_key(name: str) -> str:
    """The canonical key for `name`: itself if canonical, its alias target if known, else unchanged."""
    return ALIASES.get(name, name)


# --- non-finite values in the store ---------------------------------------------------------------
# MLflow's SQL stores keep NaN but clamp +-inf to +-max-float with no flag. Whenever rldiag writes an
# infinite value it also writes `INF_FLAG_PREFIX + key` = +1.0 (for +inf) or -1.0 (for -inf) at the
# same step, so the read side can tell a real inf from a huge finite number.
INF_FLAG_PREFIX = "rldiag/inf/"


def inf_flag_key(key: str) -> str:
    """The companion key that marks `key`'s infinite values (see INF_FLAG_PREFIX)."""
    return INF_FLAG_PREFIX + key


# --- run metadata ---------------------------------------------------------------------------------
TAG_GROUP = "rldiag.group"
TAG_VARIANT = "rldiag.variant"
TAG_ROLE = "rldiag.role"
TAG_SEED = "rldiag.seed"
ROLES = ("reference", "candidate")

# Written by the alert sink on the run that went non-finite.
TAG_ALERT_COUNT = "rldiag.alert.count"
TAG_ALERT_FIRST_STEP = "rldiag.alert.first_step"
TAG_ALERT_LAST = "rldiag.alert.last"
# Where the NaN of the first alert entered: "from the loss ..." or "at <parameter> ..." (collectors/nan_origin.py).
TAG_ALERT_ORIGIN = "rldiag.alert.origin"
ALERTS_ARTIFACT = "rldiag/alerts.jsonl"
