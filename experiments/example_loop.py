"""A small on-policy RL loop watched by rldiag: the collectors exactly as a user adds them.

    rldiag demo                                   # 40 rollout steps into sqlite:///mlruns.db
    rldiag demo --steps 100 --nan-at 30 --policy skip

A tiny random-init transformer samples completions of ragged length for random prompts; the reward is
the fraction of completion tokens in the lower quarter of the vocabulary (learnable in a few dozen
steps); a PPO/GRPO-style clipped token objective with group-normalised advantages, `ppo_epochs`
optimizer steps per rollout so the ratio moves away from 1.0 on the later ones. `--nan-at STEP`
injects a NaN gradient (finite forward) into sample 1, token 3 of the logits at that optimizer step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

from rldiag.collectors import Monitor, keys, policy_metrics
from rldiag.experiments.tiny_policy import PolicyConfig, TinyPolicy, sample, token_logprobs


@dataclass
class LoopConfig:
    steps: int = 40  # rollout steps
    prompts: int = 4  # prompts per rollout
    group: int = 4  # completions per prompt (advantages are normalised within a group)
    prompt_len: int = 4  # tokens
    completion_len: int = 16  # longest completion; lengths vary from half of it
    ppo_epochs: int = 2  # optimizer steps per rollout
    lr: float = 3e-3
    eps: float = 0.2  # clip range
    max_grad_norm: float = 1.0
    seed: int = 0
    nan_at: int | None = None  # optimizer step at which to inject a NaN gradient
    policy: str = "skip"  # what rldiag does on non-finite gradients: warn | skip | raise
    experiment: str = "rldiag-demo"
    run_name: str = "example-loop"

    def __post_init__(self) -> None:
        last = self.steps * self.ppo_epochs - 1  # optimizer steps are counted from 0
        if self.steps < 1:
            raise ValueError(f"steps={self.steps}: give 1 or more rollout steps")
        if self.nan_at is not None and not 0 <= self.nan_at <= last:
            raise ValueError(f"nan_at={self.nan_at} is outside the run's optimizer steps 0-{last} ({self.steps} "
                             f"rollouts x {self.ppo_epochs} optimizer steps each): give a step in that range")


@dataclass
class LoopResult:
    run_id: str
    final_reward: float
    first_nonfinite_step: int | None
    undelivered: int


def reward_fn(completions: torch.Tensor, mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """Fraction of valid completion tokens with id < vocab/4."""
    good = (completions < vocab // 4).float() * mask
    return good.sum(1) / mask.sum(1).clamp(min=1)


def run(cfg: LoopConfig, *, tracking_uri: str | None = None, progress: bool = True) -> LoopResult:
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    pcfg = PolicyConfig()
    model = TinyPolicy(pcfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    n = cfg.prompts * cfg.group
    first_bad: int | None = None
    reward = torch.zeros(())
    tags = {keys.TAG_GROUP: "example", keys.TAG_VARIANT: "example-loop", keys.TAG_ROLE: "reference",
            keys.TAG_SEED: str(cfg.seed)}
    with Monitor(cfg.experiment, run_name=cfg.run_name, tags=tags, params={"loop": asdict(cfg), "model": asdict(pcfg)},
                 tracking_uri=tracking_uri, policy=cfg.policy) as mon:
        opt_step = 0
        for _ in tqdm(range(cfg.steps), desc=cfg.run_name, unit="step", disable=not progress):
            prompts = torch.randint(0, pcfg.vocab, (cfg.prompts, cfg.prompt_len), generator=gen)
            prompts = prompts.repeat_interleave(cfg.group, 0)
            completions, lp_old = sample(model, prompts, cfg.completion_len, generator=gen)
            lengths = torch.randint(cfg.completion_len // 2, cfg.completion_len + 1, (n,), generator=gen)
            mask = torch.arange(cfg.completion_len)[None, :] < lengths[:, None]
            reward = reward_fn(completions, mask.float(), pcfg.vocab)
            grouped = reward.view(cfg.prompts, cfg.group)
            adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1, 1)
            ids = torch.cat([prompts, completions], 1)
            for epoch in range(cfg.ppo_epochs):
                logits = mon.watch(model(ids))
                comp_logits = logits[:, cfg.prompt_len - 1 : -1]  # the logits that predicted each completion token
                lp_new = token_logprobs(comp_logits, completions)
                ratio = (lp_new - lp_old).exp()
                obj = torch.minimum(ratio * adv, ratio.clamp(1 - cfg.eps, 1 + cfg.eps) * adv)
                loss = -(torch.where(mask, obj, 0.0).sum() / mask.sum())
                if opt_step == cfg.nan_at:  # finite forward (sqrt(0) = 0), NaN backward (inf * 0)
                    loss = loss + 0.0 * ((logits[1, 3] - logits[1, 3].detach()) ** 2).sum().sqrt()
                loss.backward()
                stats = policy_metrics(
                    lp_new.detach(), lp_old, mask, eps_low=cfg.eps, eps_high=cfg.eps, logits=comp_logits.detach(),
                    rewards=reward, lp_trainer_at_rollout=lp_new.detach() if epoch == 0 else None,
                )
                if mon.step(opt_step, model, loss=loss, metrics=stats, max_norm=cfg.max_grad_norm):  # checks, clips
                    opt.step()
                if first_bad is None and not mon.last_report.finite:
                    first_bad = opt_step
                opt.zero_grad()
                opt_step += 1
        run_id = mon.run_id
    return LoopResult(run_id, float(reward.mean()), first_bad, mon.writer.stats.undelivered)
