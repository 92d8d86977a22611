"""Where every foreign metric name comes from: each RL framework's key, read in that framework's own source.

`FOREIGN_METRICS` lists, per framework, the exact key string the framework logs, what it measures, and the
file it was read from (repository and path, as of the snapshots read on 2026-12-07; Miles's on 2026-12-08).
`canonical` is the rldiag key it is read as, only where the two definitions agree (aggregation or scaling may
differ: then `definition` says how); `None` means rldiag keeps it under its own name (a known metric, never
mapped onto a near one). `keys.ALIASES` is the table the loader applies; a test pins that the two agree both ways.
`aliases_markdown()` renders the table for docs/metrics.md.

Rule for the ratio-based policy metrics: rldiag's `policy/ratio_*`, `policy/kl_new_old*` and `policy/ess*` are
against the engine's logprobs (the rollout policy). A framework whose "old" logprobs are the trainer's own,
recomputed before the update (verl, OpenRLHF, ROLL, AReaL's proximal policy, NeMo-RL's `prev_logprobs`), logs a
ratio that is exactly 1 where rldiag's shows the train-inference mismatch: it is never aliased to those keys.
"""

from __future__ import annotations

from typing import NamedTuple

from rldiag.collectors import keys as K


class ForeignMetric(NamedTuple):
    framework: str
    key: str  # the exact string the framework logs
    canonical: str | None  # the rldiag key it is read as; None: kept under its own name
    definition: str
    source: str  # "owner/repo path/in/repo", where the key and its computation were read


_TRL = "huggingface/trl trl/trainer/grpo_trainer.py"
_HF = "huggingface/transformers src/transformers/trainer.py"
_HF_REWRITE = "huggingface/transformers src/transformers/integrations/integration_utils.py (rewrite_logs)"
_VERL_CORR = "volcengine/verl verl/trainer/ppo/rollout_corr_helper.py"
_VERL_DEBUG = "volcengine/verl verl/utils/debug/metrics.py"
_VERL_ALGOS = "volcengine/verl verl/trainer/ppo/core_algos.py"
_VERL_ACTOR = "volcengine/verl verl/workers/actor/dp_actor.py"
_VERL_DATA = "volcengine/verl verl/trainer/ppo/metric_utils.py (compute_data_metrics)"
_NEMO = ("NVIDIA-NeMo/RL nemo_rl/algorithms/loss/loss_functions.py (logged with prefix train/ by "
         "nemo_rl/algorithms/grpo.py)")
_SLIME = ("THUDM/slime slime/backends/megatron_utils/loss.py (logged as train/<key> by "
          "slime/backends/megatron_utils/model.py)")
_MILES = ("radixark/miles miles/backends/training_utils/loss_hub/losses.py (logged as train/<key> by "
          "miles/backends/training_utils/log_utils.py)")
_MILES_MATH = "radixark/miles miles/backends/training_utils/loss_hub/math_utils.py"
_MILES_TIS = "radixark/miles miles/backends/training_utils/loss_hub/corrections.py"
_PRIME = "PrimeIntellect-ai/prime-rl src/prime_rl/trainer/rl/train.py, src/prime_rl/trainer/rl/loss.py"
_ORLHF = "OpenRLHF/OpenRLHF openrlhf/models/loss.py (logged as train/<key> by openrlhf/utils/logging_utils.py)"
_SKYRL = "NovaSky-AI/SkyRL skyrl/train/trainer.py"
_SKYRL_WORKER = ("NovaSky-AI/SkyRL skyrl/backends/skyrl_train/workers/worker.py, "
                 "skyrl/backends/skyrl_train/utils/ppo_utils.py")
_AREAL = "inclusionAI/AReaL areal/trainer/ppo/actor.py, areal/utils/functional/functional.py"
_ROLL = "alibaba/ROLL roll/utils/train_infer_corrections.py (@sum stripped by roll/utils/tracking.py)"
_ROLL_PG = "alibaba/ROLL roll/pipeline/rlvr/actor_pg_worker.py"
_ROLL_GRAD = "alibaba/ROLL roll/distributed/strategy/fsdp2_strategy.py"
_PRL = "ServiceNow/PipelineRL pipelinerl/finetune/rl/__init__.py (prefix rl/ from pipelinerl/finetune/rl/utils.py)"
_PRL_ESS = "ServiceNow/PipelineRL pipelinerl/finetune_loop.py"

# Same weights, same tokens: |lp_trainer - lp_engine| where lp_trainer is the trainer at the rollout weights.
_ABS = "|lp_trainer - lp_engine| at the rollout weights over valid tokens"

_TRL_METRICS: tuple[ForeignMetric, ...] = (
    ForeignMetric("TRL", "sampling/sampling_logp_difference/mean", K.MISMATCH_LOGPROB_MEAN,
                  f"{_ABS} (old_per_token_logps vs vLLM's); token mean per process, then mean over processes", _TRL),
    ForeignMetric("TRL", "sampling/sampling_logp_difference/max", K.MISMATCH_LOGPROB_MAX,
                  f"{_ABS}; max over processes", _TRL),
    ForeignMetric("TRL", "sampling/importance_sampling_ratio/min", None,
                  "exp(lp_trainer - lp_vllm) at the rollout weights, truncated or masked at "
                  "vllm_importance_sampling_clip_min/max, per token or (sequence modes) exp of the sum per "
                  "sequence", _TRL),
    ForeignMetric("TRL", "sampling/importance_sampling_ratio/mean", None, "as .../min: the mean", _TRL),
    ForeignMetric("TRL", "sampling/importance_sampling_ratio/max", None, "as .../min: the max", _TRL),
    ForeignMetric("TRL", "clip_ratio/region_mean", K.CLIP_ACTIVE_RATE,
                  "tokens with (r < 1-eps_low and A < 0) or (r > 1+eps_high and A > 0), global token mean; per "
                  "sequence under GSPO", _TRL),
    ForeignMetric("TRL", "clip_ratio/low_mean", None, "the A < 0 side of clip_ratio/region_mean alone", _TRL),
    ForeignMetric("TRL", "clip_ratio/high_mean", None, "the A > 0 side of clip_ratio/region_mean alone", _TRL),
    ForeignMetric("TRL", "kl", K.KL_REF, "k3 KL to the reference model, logged when beta != 0", _TRL),
    ForeignMetric("TRL", "entropy", K.ENTROPY, "token entropy of the temperature-scaled distribution, token mean",
                  _TRL),
    ForeignMetric("TRL", "reward", K.REWARD_MEAN, "mean of the weighted sum of reward functions", _TRL),
    ForeignMetric("TRL", "reward_std", K.REWARD_STD, "its standard deviation", _TRL),
    ForeignMetric("TRL", "grad_norm", K.GRAD_NORM, "transformers Trainer: total norm returned by gradient clipping",
                  _HF),
    ForeignMetric("TRL", "train/loss", K.LOSS, "transformers' loss under W&B/TensorBoard (train/ prefix)",
                  _HF_REWRITE),
)
# transformers' W&B and TensorBoard callbacks prefix every training log with train/ (rewrite_logs): the same
# metrics, read from a W&B or TensorBoard run.
_TRL_PREFIXED = tuple(
    m._replace(key="train/" + m.key, definition=f"`{m.key}` as W&B/TensorBoard log it", source=_HF_REWRITE)
    for m in _TRL_METRICS if m.canonical is not None and not m.key.startswith("train/")
)

FOREIGN_METRICS: tuple[ForeignMetric, ...] = (
    *_TRL_METRICS,
    *_TRL_PREFIXED,
    # --- verl
    ForeignMetric("verl", "training/rollout_probs_diff_max", K.MISMATCH_PROB_MAX,
                  "max |exp(old_log_probs) - exp(rollout_log_probs)| over valid tokens (actor vs rollout, same "
                  "weights)", _VERL_DEBUG),
    ForeignMetric("verl", "training/rollout_probs_diff_mean", None, "the same, mean (rldiag has the max only)",
                  _VERL_DEBUG),
    ForeignMetric("verl", "rollout_corr/kl", None, "k1 KL, masked mean of rollout_log_prob - old_log_prob", _VERL_CORR),
    ForeignMetric("verl", "rollout_corr/k3_kl", None, "k3 KL with r = exp(old_log_prob - rollout_log_prob)",
                  _VERL_CORR),
    ForeignMetric("verl", "rollout_corr/log_ppl_diff", None, "mean over sequences of the rollout's minus the "
                  "actor's mean token logprob", _VERL_CORR),
    ForeignMetric("verl", "rollout_corr/chi2_token", None, "E[rho^2] - 1, rho = exp(old - rollout) per token",
                  _VERL_CORR),
    ForeignMetric("verl", "rollout_corr/rollout_is_eff_sample_size", None,
                  "1 / mean((w / mean w)^2) of the truncated actor/rollout weights at the rollout weights (not "
                  "the new/old ratio: policy/ess)", _VERL_CORR),
    ForeignMetric("verl", "rollout_corr/rollout_is_mean", None, "mean of those IS weights", _VERL_CORR),
    ForeignMetric("verl", "actor/pg_clipfrac", K.CLIP_ACTIVE_RATE,
                  "tokens where the clipped PPO loss is the larger (clip binding), token mean per micro-batch, "
                  "averaged over micro-batches; ratio against the actor's recomputed old_log_prob", _VERL_ALGOS),
    ForeignMetric("verl", "actor/ppo_kl", None, "k1 of log_prob vs the actor's recomputed old_log_prob",
                  _VERL_ALGOS),
    ForeignMetric("verl", "actor/entropy", K.ENTROPY, "token entropy, aggregated per loss_agg_mode", _VERL_ACTOR),
    ForeignMetric("verl", "actor/grad_norm", K.GRAD_NORM, "total gradient norm before clipping", _VERL_ACTOR),
    ForeignMetric("verl", "critic/score/mean", K.REWARD_MEAN,
                  "mean over the batch's sequences of the reward function's score (token_level_scores summed per "
                  "sequence), aborted sequences left out", _VERL_DATA),
    ForeignMetric("verl", "critic/rewards/mean", None,
                  "the same after the in-reward KL penalty (token_level_rewards; the score when use_kl_in_reward is "
                  "off)", _VERL_DATA),
    # --- NeMo-RL
    ForeignMetric("NeMo-RL", "train/token_mult_prob_error", K.MISMATCH_TOKEN_MULT_PROB_ERROR,
                  "masked mean of exp(|generation_logprobs - prev_logprobs|), global token mean", _NEMO),
    ForeignMetric("NeMo-RL", "train/gen_kl_error", None,
                  "KL(P_gen || P_train), reference_policy_kl_type estimator (k3 default) of prev vs generation "
                  "logprobs", _NEMO),
    ForeignMetric("NeMo-RL", "train/policy_kl_error", None, "KL(P_train || P_gen), the same estimator", _NEMO),
    ForeignMetric("NeMo-RL", "train/probs_ratio", None, "mean exp(curr - prev_logprobs), prev = the trainer's",
                  _NEMO),
    # --- slime
    ForeignMetric("slime", "train/train_rollout_logprob_abs_diff", K.MISMATCH_LOGPROB_MEAN,
                  "|old_log_probs - rollout_log_probs| (current log_probs under --use-rollout-logprobs), "
                  "per-sample token means summed over samples (sample-level aggregation)", _SLIME),
    ForeignMetric("slime", "train/pg_clipfrac", K.CLIP_ACTIVE_RATE,
                  "tokens where the clipped loss binds (pg_losses2 > pg_losses1), per-sample means", _SLIME),
    ForeignMetric("slime", "train/ppo_kl", None, "k1 of old_log_probs - log_probs, per-sample means", _SLIME),
    ForeignMetric("slime", "train/grad_norm", K.GRAD_NORM, "total gradient norm",
                  "THUDM/slime slime/backends/megatron_utils/model.py"),
    # --- Miles (radixark's fork of slime: the shared names are the same formulas)
    ForeignMetric("Miles", "train/train_rollout_logprob_abs_diff", K.MISMATCH_LOGPROB_MEAN,
                  "|lp_trainer - lp_engine| at the rollout weights (the trainer's recomputed log_probs vs "
                  "rollout_log_probs), per-sample token means averaged over samples; 0 under --use-rollout-logprobs, "
                  "where its old logprobs are the rollout's", _MILES),
    ForeignMetric("Miles", "train/train_rollout_kl", None,
                  "k3 KL(rollout || trainer) at the sampled tokens, r = exp(lp_trainer - lp_rollout), log-ratio "
                  "clamped to [-10, 10], the trainer at the rollout weights (not the updated policy: "
                  "policy/kl_new_old), per-sample means", _MILES),
    ForeignMetric("Miles", "train/ess_ratio", None,
                  "per sample (sum w)^2 / (n sum w^2), w = exp(log_probs - old_log_probs), old the trainer's "
                  "recomputed (the rollout's under --use-rollout-logprobs), averaged over samples: a per-sequence "
                  "ESS, not the batch's (policy/ess)", _MILES_MATH),
    ForeignMetric("Miles", "train/ois", None, "exp(log_probs - old_log_probs), per-sample means (with --use-tis or "
                  "--get-mismatch-metrics)", _MILES),
    ForeignMetric("Miles", "train/tis", None,
                  "exp(lp_trainer - lp_rollout) at the rollout weights before truncation to [tis_clip_low, "
                  "tis_clip], per-sample means (with --use-tis or --get-mismatch-metrics)", _MILES_TIS),
    ForeignMetric("Miles", "train/tis_clipfrac", None, "tokens whose train/tis weight the truncation changed",
                  _MILES_TIS),
    ForeignMetric("Miles", "train/pg_clipfrac", K.CLIP_ACTIVE_RATE,
                  "tokens where the clipped loss binds (pg_losses2 > pg_losses1), per-sample means", _MILES_MATH),
    ForeignMetric("Miles", "train/ppo_kl", None, "k1 of old_log_probs - log_probs, per-sample means", _MILES),
    ForeignMetric("Miles", "train/grad_norm", K.GRAD_NORM, "global gradient L2 norm before clipping",
                  "radixark/miles miles/backends/training_utils/log_utils.py (log_train_step)"),
    # --- prime-rl
    ForeignMetric("prime-rl", "mismatch_kl/all/mean", K.KL_NEW_OLD,
                  "k3 (r - log r - 1) with r = exp(trainer_logprobs - inference_logprobs), the trainer's current "
                  "logprobs vs the engine's; mean over every valid token of every rank", _PRIME),
    ForeignMetric("prime-rl", "mismatch_kl/all/max", None, "the same, max (no canonical max of KL)", _PRIME),
    ForeignMetric("prime-rl", "entropy/all/mean", K.ENTROPY,
                  "token entropy of the temperature-scaled logits, mean over valid tokens", _PRIME),
    ForeignMetric("prime-rl", "optim/grad_norm", K.GRAD_NORM, "total gradient norm before clipping", _PRIME),
    # --- OpenRLHF
    ForeignMetric("OpenRLHF", "train/ppo_clip_ratio", K.CLIP_ACTIVE_RATE,
                  "tokens where surr2 < surr1 (clip binding), masked mean; ratio against the actor's recomputed "
                  "old_log_probs", _ORLHF),
    ForeignMetric("OpenRLHF", "ppo_clip_ratio", K.CLIP_ACTIVE_RATE, "the same, unprefixed", _ORLHF),
    ForeignMetric("OpenRLHF", "train/vllm_kl", None,
                  "k1, masked mean of rollout_log_probs - old_log_probs (vLLM vs actor at the rollout weights)",
                  _ORLHF),
    ForeignMetric("OpenRLHF", "train/ppo_kl", None, "k1 of the actor's recomputed old_log_probs vs log_probs", _ORLHF),
    # --- SkyRL
    ForeignMetric("SkyRL", "policy/rollout_train_logprobs_abs_diff_mean", K.MISMATCH_LOGPROB_MEAN,
                  f"{_ABS} (forward-pass action_log_probs vs rollout_logprobs), token mean", _SKYRL),
    ForeignMetric("SkyRL", "policy/rollout_train_logprobs_abs_diff_max", K.MISMATCH_LOGPROB_MAX, f"{_ABS}, max",
                  _SKYRL),
    ForeignMetric("SkyRL", "policy/loss_metrics/clip_ratio", K.CLIP_ACTIVE_RATE,
                  "tokens where -surr2 > -surr1 (clip binding), masked mean per micro-batch", _SKYRL_WORKER),
    ForeignMetric("SkyRL", "policy/policy_entropy", K.ENTROPY, "masked mean token entropy per micro-batch",
                  _SKYRL_WORKER),
    # --- AReaL
    ForeignMetric("AReaL", "ppo_actor/update/clip_ratio/avg", K.CLIP_ACTIVE_RATE,
                  "tokens where pg_loss1 < pg_loss2 (clip binding), valid-token mean; ratio against the proximal "
                  "policy", _AREAL),
    ForeignMetric("AReaL", "ppo_actor/update/entropy/avg", K.ENTROPY, "token entropy, valid-token mean", _AREAL),
    ForeignMetric("AReaL", "ppo_actor/update/behave_imp_weight/avg", None,
                  "exp(proximal - behaviour logprobs) after rejection sampling/truncation", _AREAL),
    ForeignMetric("AReaL", "ppo_actor/update/behave_approx_kl/avg", None, "proximal vs behaviour log-ratio", _AREAL),
    ForeignMetric("AReaL", "ppo_actor/update/importance_weight/avg", None, "exp(logprobs - proximal_logprobs)",
                  _AREAL),
    # --- ROLL
    ForeignMetric("ROLL", "actor/train_infer_ratio_token_mean", None,
                  "exp(old_log_probs - infer_logprobs) per token, seq-mean-token-mean", _ROLL),
    ForeignMetric("ROLL", "actor/train_infer_diff_token_mean", None,
                  "exp(old_log_probs) - exp(infer_logprobs) (signed), seq-mean-token-mean", _ROLL),
    ForeignMetric("ROLL", "actor/ppo_ratio_clipfrac", None,
                  "ratio outside [1-clip_low, 1+clip_high] against the recomputed old_log_probs, agg_loss", _ROLL_PG),
    ForeignMetric("ROLL", "actor/ratio_mean", None, "exp(log_probs - old_log_probs), the recomputed old", _ROLL_PG),
    ForeignMetric("ROLL", "actor_train/grad_norm", K.GRAD_NORM, "total gradient norm (<worker name>/grad_norm)",
                  _ROLL_GRAD),
    # --- PipelineRL (old_logprobs are the engine's)
    ForeignMetric("PipelineRL", "rl/kl_new_old", K.KL_NEW_OLD,
                  "k3 with r = exp(new - old), per-sequence token means averaged over sequences", _PRL),
    ForeignMetric("PipelineRL", "kl_new_old", K.KL_NEW_OLD, "the same, unprefixed", _PRL),
    ForeignMetric("PipelineRL", "rl/clamp_log_ratio_new_old_indicator", K.CLIP_RATE,
                  "tokens whose ratio the clamp changed (outside the band), per-sequence means averaged", _PRL),
    ForeignMetric("PipelineRL", "clamp_log_ratio_new_old_indicator", K.CLIP_RATE, "the same, unprefixed", _PRL),
    ForeignMetric("PipelineRL", "rl/ratio_new_old", K.RATIO_MEAN,
                  "exp(new - old), per-sequence means averaged (clamped at 1+epsilon_high under its reinforce loss)",
                  _PRL),
    ForeignMetric("PipelineRL", "rl/ess", K.POLICY_ESS,
                  "(sum r)^2 / (sum r^2) / n_tokens over the step's valid tokens, r = exp(new - old)", _PRL_ESS),
    ForeignMetric("PipelineRL", "rl/entropy", K.ENTROPY, "token entropy, per-sequence means averaged", _PRL),
)

# Looked for and not found in the sources read (listed, never guessed).
NOT_READ: tuple[tuple[str, str], ...] = (
    ("AReaL", "no train-inference logprob-difference metric found (its mismatch is the behave_* family)"),
    ("ROLL", "no effective-sample-size metric found"),
)


def aliases() -> dict[str, str]:
    """`{foreign key: canonical key}` for every entry whose definition agrees with rldiag's."""
    return {m.key: m.canonical for m in FOREIGN_METRICS if m.canonical is not None}


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def aliases_markdown() -> str:
    """The table for docs/metrics.md: framework, their key, rldiag key, definition, source file."""
    lines = ["| framework | their key | rldiag key | definition | source |", "|---|---|---|---|---|"]
    for m in FOREIGN_METRICS:
        target = f"`{m.canonical}`" if m.canonical else "own name (not aliased)"
        lines.append(f"| {m.framework} | `{m.key}` | {target} | {_cell(m.definition)} | {_cell(m.source)} |")
    lines += ["", "Not found in source:", ""]
    lines += [f"- {fw}: {why}" for fw, why in NOT_READ]
    return "\n".join(lines) + "\n"
