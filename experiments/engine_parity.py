"""Engine parity: the vLLM V0-vs-V1 train-inference mismatch, reproduced with a real vLLM engine.

    rldiag experiment engine-parity                          # every variant, 3 reference seeds
    rldiag experiment engine-parity --steps 10 --variants v0-parity,v1-defaults
    python -m rldiag.experiments.engine_parity --steps 30           # the same without the rldiag entry point

Online RL with a GSPO objective (sequence ratio `s_i = exp(mean_t(lp_new - lp_old))`, clipped to
`[1-eps_low, 1+eps_high]`, group-normalised advantages, one optimizer step per rollout): a tiny
random-init Qwen2 is trained in float32 by torch; a real vLLM engine serving the same weights samples
the rollouts and is updated after every optimizer step. `lp_old` is the engine's logprob, as in
PipelineRL, so whatever the engine computes differently from the trainer moves the ratio, the clip
rate and the KL from the first step. The trainer always scores tokens the way V0 did
(`log_softmax(top_p(logits / T))`); the variants change only the engine (one MLflow run each, tags
`rldiag.group=v0_vs_v1`, `rldiag.variant`, `rldiag.role`, `rldiag.seed`):

    v0-parity              processed logprobs, no prefix cache, float32, weights loaded while paused (reference)
    v1-defaults            raw logprobs, prefix cache kept across weight updates, async scheduling requested
    raw-logprobs           v0-parity with raw logprobs (before temperature and top-p)
    prefix-cache-no-reset  v0-parity with prefix caching and no cache reset after a weight update
    prefix-cache-reset     control: prefix caching, the cache reset after every weight update
    bf16-engine            v0-parity with a bfloat16 engine
    bf16-fp32-lm-head      bf16-engine with the lm_head projection in float32 (hf_overrides head_dtype)
    trainer-no-temperature v0-parity engine; the trainer scores log_softmax(logits), without temperature/top-p
    lr-x10                 v0-parity with a learning rate 10x the default (parity holds; the updates overshoot)

Reward: the fraction of completion tokens among the "target" quarter of the vocabulary. Prompts come
from a fixed pool, longer than one KV block, so that a prefix cache kept across weight updates is hit.
Runs that share engine settings share one engine (vLLM start-up is ~20 s on a CPU).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO

import torch
from tqdm.auto import tqdm

from rldiag.collectors import Monitor, keys, policy_metrics
from rldiag.collectors.integrations.vllm import process_logits, rollout_from_outputs
from rldiag.experiments.console import library_output_to, log_file
from rldiag.experiments.parity_engine import Engine, EngineConfig, config_params, start_engine
from rldiag.experiments.summary import RunSummary, format_summaries
from rldiag.experiments.tiny_hf_model import VLLM_TINY_QWEN2, build_tiny_qwen2, save_tiny_qwen2

GROUP = "v0_vs_v1"
REFERENCE = "v0-parity"
# Experiment-specific per-step values (not canonical metrics, so not in rldiag.collectors.keys).
# prompt tokens served from the prefix cache / prompt tokens; includes the blocks that the `group`
# samples of one prompt share within a step (same weights: harmless)
# This experiment's own metrics (not canonical: rldiag.collectors.keys does not know them)
KEY_PREFIX_HIT = "engine/prefix_cache_hit_rate"  # vLLM's prefix-cache hits over queries
KEY_OUTSIDE_TOP_P = "mismatch/outside_trainer_top_p"  # sampled tokens that the trainer's top-p drops


@dataclass(frozen=True)
class Variant:
    """One engine configuration and weight-sync protocol; one MLflow run per seed."""

    engine: EngineConfig  # how the engine is started
    pause_for_weights: bool = True  # load weights with scheduling paused (V0's engine-boundary load)
    reset_cache_on_update: bool = False  # reset the prefix cache after each weight load
    trainer_sampling: bool = True  # the trainer applies the sampling temperature and top-p to its logits
    lr_scale: float = 1.0  # learning rate multiplier over ParityConfig.lr
    note: str = ""  # what the variant changes, for the run description


VARIANTS: dict[str, Variant] = {
    REFERENCE: Variant(EngineConfig(), note="V0 semantics pinned explicitly"),
    "v1-defaults": Variant(EngineConfig(logprobs_mode="raw_logprobs", enable_prefix_caching=True,
                                        async_scheduling=True), pause_for_weights=False,
                           note="V1 runtime defaults"),
    "raw-logprobs": Variant(EngineConfig(logprobs_mode="raw_logprobs"), note="logprobs before temperature/top-p"),
    "prefix-cache-no-reset": Variant(EngineConfig(enable_prefix_caching=True),
                                     note="KV computed before a weight update is reused after it"),
    "prefix-cache-reset": Variant(EngineConfig(enable_prefix_caching=True), reset_cache_on_update=True,
                                  note="control: prefix caching with a reset after every weight update"),
    "bf16-engine": Variant(EngineConfig(dtype="bfloat16"), note="bfloat16 weights and activations in the engine"),
    "bf16-fp32-lm-head": Variant(EngineConfig(dtype="bfloat16", lm_head_fp32=True),
                                 note="bfloat16 engine, lm_head projection in float32"),
    # Not engine settings: the same engine as the reference, so these share its engine (no extra start).
    "trainer-no-temperature": Variant(EngineConfig(), trainer_sampling=False,
                                      note="the trainer's recompute ignores temperature and top-p"),
    "lr-x10": Variant(EngineConfig(), lr_scale=10.0, note="learning rate 10x the default"),
}


@dataclass
class ParityConfig:
    # rollout steps per run (one GSPO optimizer step each): the detector needs 22-31 compared steps on these
    # metrics before a run that stays inside says "within the band" (20 left the control "cannot tell")
    steps: int = 36
    seeds: int = 3  # seeds of the reference variant (the noise band); candidates run seed 0
    variants: tuple[str, ...] = tuple(VARIANTS)  # which variants to run
    prompts: int = 8  # prompts per rollout, the whole fixed pool each step
    group: int = 4  # completions per prompt (advantages normalised within a group)
    prompt_len: int = 40  # tokens; > one 32-token KV block, so the prefix cache can hit
    completion_len: int = 16  # tokens per completion (eos ignored: every completion has this length)
    vocab: int = 64  # token ids; 0-2 are <pad>, <eos>, <unk>
    init_std: float = 0.1  # initializer_range of the random-init policy (0.02 gives a flat distribution)
    temperature: float = 0.7  # sampling temperature (< 1: raw and processed logprobs differ)
    top_p: float = 0.9  # nucleus sampling (< 1: processed logprobs are renormalised)
    lr: float = 1e-3  # AdamW learning rate
    eps_low: float = 3e-4  # GSPO sequence-ratio clip range, below 1 (GSPO paper)
    eps_high: float = 4e-4  # ... above 1
    max_grad_norm: float = 1.0  # gradient clipping
    experiment: str = "rldiag-engine-parity"  # MLflow experiment
    extra: dict[str, str] = field(default_factory=dict)  # further params to log (e.g. who ran it)

    def __post_init__(self) -> None:
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown:
            raise ValueError(f"unknown variant {', '.join(map(repr, unknown))}; allowed: {', '.join(VARIANTS)}")
        if self.seeds < 1 or self.steps < 1:
            raise ValueError(f"--seeds {self.seeds} / --steps {self.steps}: both must be at least 1")


@dataclass
class StepRecord:
    """The first-step numbers that the summary prints (also in the store)."""

    mismatch_mean: float
    mismatch_max: float
    ratio_mean: float
    clip_rate_seq: float


def target_reward(tokens: torch.Tensor, mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """`[N]` fraction of valid completion tokens among the target words, ids `3 .. 3 + (vocab-3)//4`."""
    hit = ((tokens >= 3) & (tokens < 3 + (vocab - 3) // 4) & mask).float()
    return hit.sum(-1) / mask.sum(-1).clamp(min=1)


def gspo_loss(lp_new: torch.Tensor, lp_old: torch.Tensor, mask: torch.Tensor, adv: torch.Tensor,
              eps_low: float, eps_high: float) -> torch.Tensor:
    """GSPO: `-mean_i min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i)`, `s_i = exp(mean_t(lp_new - lp_old))`.

    Token log-ratios at masked positions, and where the trainer gives a sampled token no probability
    (`lp_new = -inf`: the token lies outside its top-p), are 0 and -inf respectively: such a row's
    ratio is 0 and it is clipped, so it adds no gradient.
    """
    lr = torch.where(mask, lp_new - lp_old, torch.zeros((), dtype=lp_new.dtype))
    s = (lr.sum(-1) / mask.sum(-1).clamp(min=1)).exp()
    obj = torch.minimum(s * adv, s.clamp(1 - eps_low, 1 + eps_high) * adv)
    return -obj.mean()


def make_prompts(cfg: ParityConfig, seed: int) -> list[list[int]]:
    """The fixed prompt pool of a run: `cfg.prompts` random word sequences (ids >= 3)."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    return torch.randint(3, cfg.vocab, (cfg.prompts, cfg.prompt_len), generator=gen).tolist()


def run_one(engine: Engine, cfg: ParityConfig, name: str, seed: int, *, tracking_uri: str | None,
            progress: bool, out: TextIO | None = None) -> tuple[RunSummary, StepRecord | None]:
    """One GSPO run of `cfg.steps` rollouts on `engine`, logged as one MLflow run (its progress bar on `out`,
    default stderr)."""
    variant = VARIANTS[name]
    model = build_tiny_qwen2(cfg.vocab, seed, initializer_range=cfg.init_std, **VLLM_TINY_QWEN2).float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr * variant.lr_scale)
    engine.load_weights(model, pause=variant.pause_for_weights)
    engine.reset_prefix_cache()  # nothing cached from the previous run's weights
    prompts = make_prompts(cfg, seed)
    tags = {keys.TAG_GROUP: GROUP, keys.TAG_VARIANT: name, keys.TAG_SEED: str(seed),
            keys.TAG_ROLE: "reference" if name == REFERENCE else "candidate", "mlflow.note.content": variant.note}
    loop = {k: v for k, v in asdict(cfg).items() if k not in ("variants", "extra")}
    loop["lr"] = cfg.lr * variant.lr_scale  # the learning rate this run trains with
    temperature, top_p = (cfg.temperature, cfg.top_p) if variant.trainer_sampling else (1.0, 1.0)
    params = {**engine.fingerprint, "loop": {**loop, "seed": seed, "objective": "gspo", "optimizer_steps_per_rollout": 1},
              "variant": {"name": name, "pause_for_weights": variant.pause_for_weights,
                          "reset_cache_on_update": variant.reset_cache_on_update,
                          "trainer_sampling": variant.trainer_sampling, "lr_scale": variant.lr_scale,
                          "engine": config_params(variant.engine)},
              "model": {"arch": "Qwen2ForCausalLM", "dtype": "float32", "lm_head_dtype": "float32",
                        "trainer_logprobs": "processed (temperature, top_p)" if variant.trainer_sampling
                        else "raw (no temperature, no top_p)", **VLLM_TINY_QWEN2},
              **cfg.extra}
    first: StepRecord | None = None
    first_bad: int | None = None
    reward = torch.tensor(float("nan"))
    with Monitor(cfg.experiment, run_name=f"{name}-seed{seed}", tags=tags, params=params,
                 tracking_uri=tracking_uri, policy="skip") as mon:
        bar = tqdm(range(cfg.steps), desc=f"{name} seed {seed}", unit="step", disable=not progress, leave=True,
                   file=out or sys.stderr)
        for step in bar:
            seeds = [seed * 1_000_003 + step * 1_000 + i for i in range(len(prompts))]
            outputs = engine.generate(prompts, n=cfg.group, max_tokens=cfg.completion_len,
                                      temperature=cfg.temperature, top_p=cfg.top_p, seeds=seeds)
            batch = rollout_from_outputs(outputs)
            if not (batch.mask.all() and batch.prompt_mask.all()):
                raise RuntimeError("expected full-length prompts and completions (ignore_eos); got ragged ones")
            mask, lp_old, tokens = batch.mask, batch.logprobs, batch.token_ids
            reward = target_reward(tokens, mask, cfg.vocab)
            grouped = reward.view(-1, cfg.group)
            adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)

            ids = torch.cat([batch.prompt_ids, tokens], 1)
            logits = mon.watch(model(input_ids=ids).logits[:, cfg.prompt_len - 1 : -1])
            processed = process_logits(logits, temperature=temperature, top_p=top_p)
            lp_new = torch.log_softmax(processed, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
            loss = gspo_loss(lp_new, lp_old, mask, adv, cfg.eps_low, cfg.eps_high)
            loss.backward()
            lp = lp_new.detach()  # the trainer at the rollout weights: this is the only step per rollout
            # A token that the engine sampled but the trainer's top-p drops (bf16 rounding moves the
            # top-p boundary) has lp = -inf: counted on its own, left out of the means (else all inf).
            outside = torch.isneginf(lp) & mask
            scored = mask & ~outside
            stats = policy_metrics(lp, lp_old, scored, eps_low=cfg.eps_low, eps_high=cfg.eps_high,
                                   logits=processed.detach(), rewards=reward, lp_trainer_at_rollout=lp,
                                   token_ids=tokens)
            stats[KEY_OUTSIDE_TOP_P] = outside.sum() / mask.sum().clamp(min=1)
            cached = batch.num_cached_tokens.clamp(min=0).sum() / batch.prompt_lengths.sum().clamp(min=1)
            stats[KEY_PREFIX_HIT] = cached.float()
            if mon.step(step, model, loss=loss, metrics=stats):
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                opt.step()
            if first_bad is None and not mon.last_report.finite:
                first_bad = step
            opt.zero_grad(set_to_none=True)
            engine.load_weights(model, pause=variant.pause_for_weights)
            if variant.reset_cache_on_update:
                engine.reset_prefix_cache()
            if first is None:
                host = {k: float(stats[k]) for k in (keys.MISMATCH_LOGPROB_MEAN, keys.MISMATCH_LOGPROB_MAX,
                                                     keys.RATIO_MEAN, keys.CLIP_RATE_SEQ)}
                first = StepRecord(*host.values())
            bar.set_postfix(reward=f"{float(reward.mean()):.2f}", clip=f"{float(stats[keys.CLIP_RATE_SEQ]):.2f}")
        bar.close()
    return RunSummary(mon.run_id, name, first_bad, float(reward.mean()), mon.writer.stats.undelivered), first


def runs_by_engine(cfg: ParityConfig) -> dict[EngineConfig, list[tuple[str, int]]]:
    """`(variant, seed)` runs grouped by the engine they need, the reference's engine first."""
    order = sorted(cfg.variants, key=lambda v: (v != REFERENCE, list(VARIANTS).index(v)))
    groups: dict[EngineConfig, list[tuple[str, int]]] = {}
    for name in order:
        seeds = range(cfg.seeds) if name == REFERENCE else range(1)
        groups.setdefault(VARIANTS[name].engine, []).extend((name, s) for s in seeds)
    return groups


def first_step_table(rows: list[tuple[str, int, StepRecord | None]]) -> str:
    """Step-0 parity per run: engine-vs-trainer logprob mismatch, ratio mean, GSPO clip rate."""
    head = f"{'variant':24} {'seed':>4}  {'mismatch mean':>13}  {'mismatch max':>12}  {'ratio mean':>10}  {'seq clip':>8}"
    lines = ["At step 0 (trainer and engine hold the same weights):", head, "-" * len(head)]
    for name, seed, r in rows:
        if r is not None:
            lines.append(f"{name:24} {seed:>4}  {r.mismatch_mean:>13.2e}  {r.mismatch_max:>12.2e}  "
                         f"{r.ratio_mean:>10.4f}  {r.clip_rate_seq:>8.3f}")
    return "\n".join(lines)


def run_experiment(cfg: ParityConfig, *, tracking_uri: str | None = None, progress: bool = True,
                   model_dir: str | Path | None = None, out: TextIO | None = None) -> list[RunSummary]:
    """Every (variant, seed) run of `cfg`, one engine at a time; returns one summary per run.

    `model_dir`: where the engine's start-up checkpoint and tokenizer go (a temp dir by default); each
    run then loads its own seed's weights into the engine. `out`: where rldiag's own lines and the
    progress bars go (default stderr; `console.library_output_to` gives the terminal's).
    """
    out = out or sys.stderr
    summaries: list[RunSummary] = []
    rows: list[tuple[str, int, StepRecord | None]] = []
    with tempfile.TemporaryDirectory(prefix="rldiag-parity-") as tmp:
        path = Path(model_dir or tmp)
        save_tiny_qwen2(path, cfg.vocab, 0, initializer_range=cfg.init_std, **VLLM_TINY_QWEN2)
        for ecfg, runs in runs_by_engine(cfg).items():
            t0 = time.monotonic()
            try:
                engine = start_engine(path, ecfg, max_model_len=cfg.prompt_len + cfg.completion_len)
            except Exception as e:  # noqa: BLE001 - only the optional fp32-head engine may be refused
                if not ecfg.lm_head_fp32:
                    raise
                print(f"skipping {', '.join(sorted({n for n, _ in runs}))}: this vLLM build refused "
                      f"hf_overrides head_dtype=float32 on a {ecfg.dtype} engine ({type(e).__name__}: {e})",
                      file=out)
                continue
            if progress:
                print(f"engine {ecfg.label()} started in {time.monotonic() - t0:.0f} s", file=out)
            try:
                if ecfg.lm_head_fp32 and engine.lm_head_dtype() != "float32":
                    print(f"skipping {', '.join(sorted({n for n, _ in runs}))}: this vLLM build "
                          f"({engine.fingerprint['engine.build']} on {engine.fingerprint['engine.platform']}) "
                          f"runs the lm_head in {engine.lm_head_dtype()} despite head_dtype=float32", file=out)
                    continue
                for name, seed in runs:
                    summary, first = run_one(engine, cfg, name, seed, tracking_uri=tracking_uri, progress=progress,
                                             out=out)
                    summaries.append(summary)
                    rows.append((name, seed, first))
            finally:
                engine.close()
    if progress:
        print(first_step_table(rows), file=out)
    return summaries


# --- command line -------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `rldiag experiment engine-parity` (the tracking URI is added by rldiag.app.cli.experiment)."""
    d = ParityConfig()
    parser.add_argument("--steps", type=int, default=d.steps, help="rollout steps per run")
    parser.add_argument("--seeds", type=int, default=d.seeds, help=f"seeds of the reference variant ({REFERENCE})")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated variants to run, from: {', '.join(VARIANTS)}")
    # dest: not `experiment` (rldiag.app.cli.experiment keeps the chosen experiment in args.experiment_name)
    parser.add_argument("--experiment", dest="mlflow_experiment", default=d.experiment, help="MLflow experiment")


def config_from_args(args: argparse.Namespace) -> ParityConfig:
    """A `ParityConfig` from the parsed options; ValueError (one line) for an unknown variant."""
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    return ParityConfig(steps=args.steps, seeds=args.seeds, variants=variants,
                        experiment=args.mlflow_experiment)


def run(args: argparse.Namespace) -> int:
    """`rldiag experiment engine-parity`: validate the options (before any engine starts), run, summarise."""
    from rldiag.collectors.settings import default_tracking_uri

    cfg = config_from_args(args)
    uri = getattr(args, "tracking_uri", None) or default_tracking_uri()
    runs = sum(len(r) for r in runs_by_engine(cfg).values())
    print(f"engine-parity: {runs} runs x {cfg.steps} steps on {len(runs_by_engine(cfg))} vLLM engines "
          "(each starts in about 20 s)", file=sys.stderr, flush=True)
    with library_output_to(log_file("engine-parity")) as term:
        summaries = run_experiment(cfg, tracking_uri=uri, out=term)
    print(format_summaries(summaries, tracking_uri=uri, experiment=cfg.experiment))
    if getattr(args, "on_done", None) is not None:  # `rldiag experiment`: the verdicts table
        args.on_done([s.run_id for s in summaries], uri)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m rldiag.experiments.engine_parity`: the same options as the rldiag command."""
    parser = argparse.ArgumentParser(prog="python -m rldiag.experiments.engine_parity", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(parser)
    parser.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, "
                                                             "else sqlite:///mlruns.db here)")
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ValueError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # the engine starts worker processes: keep module import side-effect free
    sys.exit(main())
