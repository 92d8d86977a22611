"""Masked vs unmasked: on-policy distillation whose teacher logprobs are padded with `-inf`.

    rldiag experiment masked-vs-unmasked                # 6 runs, 40 steps each, into sqlite:///mlruns.db
    rldiag experiment masked-vs-unmasked --steps 10 --seeds 0,1 --configs 1x2,4x1 --variants unmasked

A real reproduction of seeds/trl-distillation-nan-pr.txt. Each optimizer step samples one generation
batch of `batch_size * accumulation` completions from a tiny random-init student (TinyPolicy), with
completion lengths that differ within the batch, right-padded to a common width, then split into
`accumulation` micro-batches that keep that width (TRL buffers one generation batch across the
accumulation steps). A second TinyPolicy with another seed is the teacher "server": it scores each
sample on its own and returns ragged logprobs, which are padded with the `-inf` sentinel. The loss is
TRL's sparse top-1 reverse KL with a tail bucket (experiments/distill_loss.py). `unmasked` is TRL
before the fix, `masked` replaces the sentinel at padding before the divergence math.

Expected: every unmasked run with batch x accumulation > 1 has `grad/finite` = 0 from step 1 while its
`loss` stays finite; the 1x1 runs (nothing to pad) and every masked run stay finite. The NaN is not
injected: it comes from the padding (`distill/teacher_nonfinite` counts the sentinels that reach the
math, and the alert's non-finite token positions are the padded ones).

Non-finite policy "skip": rldiag zeroes the NaN gradients and the optimizer does not step, so the
weights stay finite and every step repeats the bug from clean weights: a finite loss and NaN
gradients on each step, the seed's exact symptom, while the run silently stops learning. ("warn"
would step on NaN gradients, turn every weight into NaN and make the loss NaN from step 2, a second
failure that hides the first.) Steps count from 1, as transformers' `Trainer.state.global_step` does.

Reward: on-policy distillation's per-token reward is the negative reverse KL on the sampled token,
`lp_teacher - lp_student`; `reward/mean` is its per-sequence mean over valid tokens, averaged over
the batch (0 would be a student equal to the teacher). The summary's final reward is the last step's.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass, field, replace
from typing import TextIO

import torch
from tqdm.auto import tqdm

from rldiag.collectors import Monitor, entropy_from_logits, keys, reward_stats
from rldiag.collectors.metrics import masked_mean
from rldiag.experiments.console import library_output_to, log_file
from rldiag.experiments.distill_loss import TeacherLogprobs, pad_ragged, sparse_top1_divergence
from rldiag.experiments.summary import RunSummary, format_summaries
from rldiag.experiments.tiny_policy import PolicyConfig, TinyPolicy, sample

GROUP = "masked_vs_unmasked"
VARIANTS = ("masked", "unmasked")
ROLE = {"masked": "reference", "unmasked": "candidate"}
PAD_ID = 0  # token id at padded completion positions
DEFAULT_EXPERIMENT = "rldiag-masked-vs-unmasked"

# This experiment's own metrics (the canonical ones come from rldiag.collectors.keys).
# This experiment's own metrics (not canonical: rldiag.collectors.keys does not know them)
LOSS_SUPPORT = "distill/loss_support"  # the top-1 support slot(s) of the distillation loss
LOSS_TAIL = "distill/loss_tail"  # its tail-bucket slot; support + tail = loss
TEACHER_NONFINITE = "distill/teacher_nonfinite"  # -inf teacher logprobs that reached the divergence math
PADDING_TOKENS = "distill/padding_tokens"  # padded completion positions over the step's micro-batches


@dataclass(frozen=True)
class DistillConfig:
    variant: str = "masked"  # masked: padding replaced before the divergence math (the fix); unmasked: before it
    batch_size: int = 1  # samples per micro-batch (TRL's per_device_train_batch_size)
    accumulation: int = 1  # micro-batches per optimizer step (gradient_accumulation_steps)
    seed: int = 0  # student init, prompts and sampling; the teacher uses seed + teacher_seed_offset
    steps: int = 40  # optimizer steps
    prompt_len: int = 4  # tokens per prompt (a fixed-width prompt block)
    min_completion_len: int = 4  # shortest completion
    max_completion_len: int = 16  # longest completion; lengths differ within every generation batch
    beta: float = 1.0  # 1.0 reverse KL (the seed's failing path); 0 < beta < 1 generalised JSD
    add_tail: bool = True  # append the tail bucket (TRL's loss_add_tail, part of the trigger)
    temperature: float = 1.0  # student sampling and loss temperature
    teacher_temperature: float = 0.5  # sharpens the random-init teacher so there is something to distill
    teacher_seed_offset: int = 1000  # the teacher is TinyPolicy initialised with seed + this
    lr: float = 3e-3  # AdamW learning rate
    max_grad_norm: float = 1.0  # clip after rldiag's check
    policy: str = "skip"  # rldiag's non-finite policy (see the module docstring)
    threads: int = 1  # torch CPU threads during the run: a model this small only loses to thread hand-offs

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"variant {self.variant!r} is not one of {VARIANTS}; e.g. --variants masked,unmasked")
        for name in ("batch_size", "accumulation", "steps", "min_completion_len", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1 (e.g. --steps 40, --configs 1x2)")
        if self.max_completion_len <= self.min_completion_len:
            raise ValueError(f"max_completion_len={self.max_completion_len} must exceed min_completion_len="
                             f"{self.min_completion_len} so that completion lengths can differ")
        if not 0 < self.beta <= 1:
            raise ValueError(f"beta={self.beta} must be in (0, 1]: 1 is reverse KL, between 0 and 1 JSD "
                             "(beta=0, forward KL, is TRL's other path, which was already masked)")

    @property
    def run_name(self) -> str:
        return f"{self.variant}-b{self.batch_size}xa{self.accumulation}"


@dataclass(frozen=True)
class ExperimentConfig:
    variants: tuple[str, ...] = VARIANTS  # one run per variant, config and seed
    configs: tuple[tuple[int, int], ...] = ((1, 1), (1, 2), (2, 1))  # (batch_size, accumulation) pairs
    seeds: tuple[int, ...] = (0,)  # replicates
    base: DistillConfig = field(default_factory=DistillConfig)  # every other setting, shared by the runs
    experiment: str = DEFAULT_EXPERIMENT  # MLflow experiment name

    def runs(self) -> list[DistillConfig]:
        return [replace(self.base, variant=v, batch_size=b, accumulation=a, seed=s)
                for s in self.seeds for v in self.variants for b, a in self.configs]


# --- data: one generation batch per optimizer step ---------------------------------------------------


def completion_lengths(n: int, cfg: DistillConfig, gen: torch.Generator) -> torch.Tensor:
    """`[n]` lengths in `[min, max]`; with n > 1 not all equal (the trigger needs ragged batches)."""
    lengths = torch.randint(cfg.min_completion_len, cfg.max_completion_len + 1, (n,), generator=gen)
    if n > 1 and bool((lengths == lengths[0]).all()):
        lengths[-1] = cfg.min_completion_len if lengths[0] != cfg.min_completion_len else cfg.max_completion_len
    return lengths


@torch.no_grad()
def teacher_server(teacher: TinyPolicy, prompts: torch.Tensor, completions: torch.Tensor, lengths: torch.Tensor,
                   temperature: float) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Score each sample on its own, like a teacher server: ragged `(actual, top1, top1_ids)` per sample."""
    p = prompts.shape[1]
    rows = []
    for prompt, completion, n in zip(prompts, completions, lengths.tolist()):
        tokens = completion[:n]
        logits = teacher(torch.cat([prompt, tokens])[None])[0, p - 1 : p - 1 + n].float() / temperature
        lp = torch.log_softmax(logits, -1)
        top1, top1_ids = lp.max(-1)
        rows.append((lp.gather(-1, tokens[:, None]).squeeze(-1), top1, top1_ids))
    return rows


def padded_teacher(rows, width: int) -> TeacherLogprobs:
    """The server's ragged answer as `[B, width]` tensors, padded with the `-inf` sentinel (ids with 0)."""
    actual, top1, ids = zip(*rows)
    return TeacherLogprobs(pad_ragged(actual, width, float("-inf")), pad_ragged(top1, width, float("-inf")),
                           pad_ragged(ids, width, 0))


# --- one run ------------------------------------------------------------------------------------------


def run_one(cfg: DistillConfig, *, experiment: str = DEFAULT_EXPERIMENT, tracking_uri: str | None = None,
            progress: bool = True, name_suffix: str = "", out: TextIO | None = None) -> RunSummary:
    """Train the student for `cfg.steps` optimizer steps under rldiag's Monitor; returns the run's summary
    (its progress bar on `out`, default stderr)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        return _train(cfg, experiment, tracking_uri, progress, cfg.run_name + name_suffix, out or sys.stderr)
    finally:
        torch.set_num_threads(threads)


def _train(cfg: DistillConfig, experiment: str, tracking_uri: str | None, progress: bool, name: str,
           out: TextIO) -> RunSummary:
    torch.manual_seed(cfg.seed + cfg.teacher_seed_offset)
    pcfg = PolicyConfig()
    teacher = TinyPolicy(pcfg).eval()
    torch.manual_seed(cfg.seed)
    student = TinyPolicy(pcfg)
    gen = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.AdamW(student.parameters(), lr=cfg.lr)
    n, p, mask_padding = cfg.batch_size * cfg.accumulation, cfg.prompt_len, cfg.variant == "masked"
    tags = {keys.TAG_GROUP: GROUP, keys.TAG_VARIANT: cfg.variant, keys.TAG_ROLE: ROLE[cfg.variant],
            keys.TAG_SEED: str(cfg.seed)}
    params = {**asdict(cfg), "model": asdict(pcfg)}
    first_bad: int | None = None
    reward = torch.full((), float("nan"))
    with Monitor(experiment, run_name=name, tags=tags, params=params, tracking_uri=tracking_uri,
                 policy=cfg.policy) as mon:
        for step in tqdm(range(1, cfg.steps + 1), desc=name, unit="step", disable=not progress, file=out):
            prompts = torch.randint(0, pcfg.vocab, (n, p), generator=gen)
            lengths = completion_lengths(n, cfg, gen)
            width = int(lengths.max())
            completions, _ = sample(student, prompts, width, temperature=cfg.temperature, generator=gen)
            required = torch.arange(width)[None, :] < lengths[:, None]  # TRL's labels != -100
            completions = torch.where(required, completions, PAD_ID)
            zero = torch.zeros((), dtype=torch.float64)
            loss, support, tail, nonfinite, entropy = zero, zero, zero, zero, zero
            rewards = []
            for mb in range(cfg.accumulation):
                rows = slice(mb * cfg.batch_size, (mb + 1) * cfg.batch_size)
                req, comp = required[rows], completions[rows]
                teacher_lps = padded_teacher(teacher_server(teacher, prompts[rows], comp, lengths[rows],
                                                            cfg.teacher_temperature), width)
                logits = student(torch.cat([prompts[rows], comp], 1))
                comp_logits = mon.watch(logits[:, p - 1 : -1])  # the logits that predicted each completion token
                student_lps = torch.log_softmax(comp_logits.float() / cfg.temperature, -1)
                div = sparse_top1_divergence(student_lps, teacher_lps, comp, req, beta=cfg.beta,
                                             add_tail=cfg.add_tail, mask_padding=mask_padding)
                (div.loss / cfg.accumulation).backward()  # TRL's loss scaling under accumulation
                slots = div.per_slot.shape[-1] - (1 if cfg.add_tail else 0)
                loss = loss + div.loss.detach() / cfg.accumulation
                support = support + masked_mean(div.per_slot[..., :slots].sum(-1), req) / cfg.accumulation
                tail = tail + masked_mean(div.per_slot[..., slots:].sum(-1), req) / cfg.accumulation
                nonfinite = nonfinite + div.teacher_nonfinite
                entropy = entropy + entropy_from_logits(comp_logits.detach(), req) / cfg.accumulation
                gap = torch.where(req, teacher_lps.actual - student_lps.detach().gather(-1, comp[..., None])[..., 0], 0.0)
                rewards.append(gap.sum(-1) / req.sum(-1).clamp(min=1))  # -reverse KL on the sampled tokens
            rs = reward_stats(torch.cat(rewards))
            reward = rs.mean
            metrics = {LOSS_SUPPORT: support, LOSS_TAIL: tail, TEACHER_NONFINITE: nonfinite,
                       PADDING_TOKENS: (~required).sum(), keys.ENTROPY: entropy, keys.REWARD_MEAN: rs.mean,
                       keys.REWARD_STD: rs.std, keys.BATCH_TOKENS: required.sum(), keys.BATCH_SEQUENCES: n}
            if mon.step(step, student, loss=loss, metrics=metrics):  # after backward, before clipping
                torch.nn.utils.clip_grad_norm_(student.parameters(), cfg.max_grad_norm)
                opt.step()
            if first_bad is None and not mon.last_report.finite:
                first_bad = step
            opt.zero_grad()
    return RunSummary(mon.run_id, name, first_bad, float(reward), mon.writer.stats.undelivered)


def run_experiment(cfg: ExperimentConfig, *, tracking_uri: str | None = None,
                   progress: bool = True, out: TextIO | None = None) -> list[RunSummary]:
    """Every (seed, variant, batch x accumulation) run, one after another; one summary per run (progress
    bars on `out`, default stderr)."""
    suffix = len(cfg.seeds) > 1
    return [run_one(r, experiment=cfg.experiment, tracking_uri=tracking_uri, progress=progress,
                    name_suffix=f"-s{r.seed}" if suffix else "", out=out) for r in cfg.runs()]


# --- command line -------------------------------------------------------------------------------------


def parse_configs(text: str) -> tuple[tuple[int, int], ...]:
    """`"1x1,1x2,2x1"` -> `((1, 1), (1, 2), (2, 1))`; ValueError naming the bad item and the fix."""
    out = []
    for item in _items(text, "--configs"):
        b, sep, a = item.lower().partition("x")
        if not (sep and b.isdigit() and a.isdigit() and int(b) >= 1 and int(a) >= 1):
            raise ValueError(f"--configs item {item!r} is not BATCHxACCUMULATION with both at least 1; "
                             "write e.g. --configs 1x1,1x2,2x1")
        out.append((int(b), int(a)))
    return tuple(out)


def parse_seeds(text: str) -> tuple[int, ...]:
    """`"0,1"` -> `(0, 1)`; ValueError naming the bad item and the fix."""
    out = []
    for item in _items(text, "--seeds"):
        if not item.isdigit():
            raise ValueError(f"--seeds item {item!r} is not a non-negative integer; write e.g. --seeds 0,1,2")
        out.append(int(item))
    return tuple(out)


def parse_variants(text: str) -> tuple[str, ...]:
    """`"masked,unmasked"` -> `("masked", "unmasked")`; ValueError naming the bad item and the fix."""
    items = _items(text, "--variants")
    for item in items:
        if item not in VARIANTS:
            raise ValueError(f"--variants item {item!r} is not one of {', '.join(VARIANTS)}; "
                             "write e.g. --variants masked,unmasked")
    return tuple(items)


def _items(text: str, option: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise ValueError(f"{option} {text!r} lists nothing; give a comma-separated list")
    return items


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = DistillConfig()
    parser.add_argument("--steps", type=int, default=d.steps, help="optimizer steps per run")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds; one run per seed, variant and config")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated: masked, unmasked")
    parser.add_argument("--configs", default="1x1,1x2,2x1",
                        help="comma-separated BATCHxACCUMULATION (per-device batch size x gradient accumulation)")
    parser.add_argument("--beta", type=float, default=d.beta, help="1.0 reverse KL; between 0 and 1 generalised JSD")
    # dest: not `experiment` (rldiag.app.cli.experiment keeps the chosen experiment in args.experiment_name)
    parser.add_argument("--experiment", dest="mlflow_experiment", metavar="NAME",
                        default=DEFAULT_EXPERIMENT,
                        help="MLflow experiment name")


def run(args: argparse.Namespace) -> int:
    from rldiag.collectors.settings import default_tracking_uri

    # a ValueError here (bad --variants, --configs, --seeds) is the command line's one-line error
    cfg = ExperimentConfig(variants=parse_variants(args.variants), configs=parse_configs(args.configs),
                           seeds=parse_seeds(args.seeds), experiment=args.mlflow_experiment,
                           base=DistillConfig(steps=args.steps, beta=args.beta))
    uri = args.tracking_uri or default_tracking_uri()
    print(f"masked-vs-unmasked: {len(cfg.runs())} runs x {args.steps} steps", file=sys.stderr, flush=True)
    with library_output_to(log_file("masked-vs-unmasked")) as term:
        summaries = run_experiment(cfg, tracking_uri=uri, out=term)
    print(format_summaries(summaries, tracking_uri=uri, experiment=cfg.experiment))
    if getattr(args, "on_done", None) is not None:  # `rldiag experiment`: the verdicts table
        args.on_done([s.run_id for s in summaries], uri)
    return 0 if all(s.undelivered == 0 for s in summaries) else 1
