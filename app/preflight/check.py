"""`rldiag preflight`'s measurement: engine vs trainer logprobs at equal weights, then knob by knob.

For one set of engine arguments: start vLLM in-process, sample the prompts at the checkpoint's weights
(this fills the prefix cache), push slightly changed weights into the engine and into the trainer's
copy (the RL loop's weight sync), sample the same prompts with the same seeds again, and recompute
those tokens' logprobs with the trainer's model (transformers, float32, the trainer's sampling
transform). The numbers are from the samples after the push, so a prefix cache kept across the push
shows. `run_preflight` does this for the user's arguments and once per knob flipped.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rldiag.app.preflight.config import KNOBS, PreflightConfig

# What the engine really ran with, as engine_fingerprint spells it.
_FP_MODE, _FP_CACHE, _FP_DTYPE = "engine.logprobs_mode", "engine.enable_prefix_caching", "engine.dtype"
_FP_HEAD, _FP_ASYNC, _FP_BLOCK = "engine.lm_head_dtype", "engine.async_scheduling", "engine.block_size"


@dataclass
class Measurement:
    """One engine's parity numbers (after the weight push); `status` says whether it was measured."""

    label: str  # "baseline" or "<knob> -> <value>"
    knob: str | None  # the knob flipped (None for the user's own arguments)
    engine_args: dict[str, Any]  # what the engine was started with
    status: str = "measured"  # measured | not_honoured | skipped | failed
    note: str = ""  # why not measured, or what the reader must know
    fingerprint: dict[str, str] = field(default_factory=dict)
    tokens: int = 0  # valid completion tokens compared
    mean: float = float("nan")  # mean |lp_trainer - lp_engine| (tokens outside the trainer's support left out)
    max: float = float("nan")
    token_mult_prob_error: float = float("nan")  # mean exp(|d|), NeMo-RL
    kl_k3: float = float("nan")  # mean (r - 1) - log r, r = exp(lp_trainer - lp_engine)
    ratio_mean: float = float("nan")  # mean r: 1.0 at parity
    outside_trainer_support: int = 0  # sampled tokens that the trainer's transform gives probability 0
    cached_prompt_tokens: int = 0  # prompt tokens the engine served from its prefix cache after the push
    mean_before_push: float = float("nan")  # the same mean at the checkpoint's weights (an empty cache)
    worst: list[dict[str, Any]] = field(default_factory=list)  # sample, position, token, both logprobs

    def passes(self, max_mismatch: float) -> bool:
        """Within the gate: measured, mean at most `max_mismatch`, no token the trainer cannot score."""
        return self.status == "measured" and self.mean <= max_mismatch and self.outside_trainer_support == 0


@dataclass
class PreflightResult:
    config: dict[str, Any]
    baseline: Measurement
    flips: list[Measurement]
    passed: bool
    verdict: str  # one line: pass/fail and which knob explains the gap
    explained_by: str | None  # the knob whose flip alone brings the mismatch under the gate
    fix: str | None
    notes: list[str]


def flipped_args(knob: str, args: dict[str, Any], fp: dict[str, str]) -> tuple[dict[str, Any] | None, str, str]:
    """`(engine args with knob flipped, label, why skipped)`; None args when the flip means nothing here."""
    out = dict(args)
    if knob == "logprobs_mode":
        value = "raw_logprobs" if fp.get(_FP_MODE) == "processed_logprobs" else "processed_logprobs"
        out["logprobs_mode"] = value
        return out, f"logprobs_mode -> {value}", ""
    if knob == "prefix_caching":
        value = fp.get(_FP_CACHE) != "True"
        out["enable_prefix_caching"] = value
        return out, f"enable_prefix_caching -> {value}", ""
    if knob == "dtype":
        value = "bfloat16" if fp.get(_FP_DTYPE) == "float32" else "float32"
        out["dtype"] = value
        return out, f"dtype -> {value}", ""
    if knob == "lm_head_fp32":
        overrides = dict(out.get("hf_overrides") or {})
        if overrides.get("head_dtype") == "float32":
            overrides.pop("head_dtype")
            out["hf_overrides"] = overrides
            return out, "lm_head_fp32 -> off", ""
        if fp.get(_FP_HEAD) == "float32":
            return None, "lm_head_fp32 -> on", f"the lm_head already runs in float32 (engine dtype {fp.get(_FP_DTYPE)})"
        out["hf_overrides"] = {**overrides, "head_dtype": "float32"}
        return out, "lm_head_fp32 -> on", ""
    if knob == "async_scheduling":
        value = fp.get(_FP_ASYNC) != "True"
        out["async_scheduling"] = value
        return out, f"async_scheduling -> {value}", ""
    raise ValueError(f"unknown knob {knob!r}; allowed: {', '.join(KNOBS)}")


def _not_honoured(knob: str | None, args: dict[str, Any], fp: dict[str, str]) -> str:
    """Why the engine ignored the flipped knob ('' when it runs as asked)."""
    build = f"this vLLM build ({fp.get('engine.build')} {fp.get('engine.version')} on {fp.get('engine.platform')})"
    if knob == "async_scheduling" and str(bool(args["async_scheduling"])) != fp.get(_FP_ASYNC):
        return f"{build} runs async_scheduling={fp.get(_FP_ASYNC)} although {args['async_scheduling']} was asked for"
    if knob == "lm_head_fp32" and (args.get("hf_overrides") or {}).get("head_dtype") == "float32" \
            and fp.get(_FP_HEAD) != "float32":
        return f"{build} runs the lm_head in {fp.get(_FP_HEAD)} despite hf_overrides head_dtype=float32"
    return ""


class Trainer:
    """The trainer's side: the float32 transformers model, its pushed copy, the tokenizer, the prompts."""

    def __init__(self, cfg: PreflightConfig):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.cfg = cfg
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model)
        self.model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32).to(cfg.trainer_device).eval()
        self.pushed = push_weights(self.model, cfg.push_scale, cfg.seed)
        self.prompts = self._prompts()
        self.seeds = [cfg.seed * 1_000_003 + i for i in range(len(self.prompts))]

    def _prompts(self) -> list[list[int]]:
        cfg = self.cfg
        if cfg.prompts_file is not None:
            lines = [ln for ln in cfg.prompts_file.read_text(encoding="utf-8").splitlines() if ln.strip()]
            if not lines:
                raise ValueError(f"--prompts-file {cfg.prompts_file}: no non-empty line")
            return [self.tokenizer(ln).input_ids for ln in lines[: cfg.num_prompts]]
        special = set(self.tokenizer.all_special_ids)
        vocab = torch.tensor([i for i in range(len(self.tokenizer)) if i not in special])
        gen = torch.Generator().manual_seed(cfg.seed)
        return vocab[torch.randint(len(vocab), (cfg.num_prompts, cfg.prompt_len), generator=gen)].tolist()

    @torch.no_grad()
    def logprobs(self, batch: Any, *, pushed: bool = True) -> torch.Tensor:
        """The trainer's logprobs of the batch's tokens under its sampling transform (pushed weights or not)."""
        from rldiag.collectors.integrations.vllm import recompute_logprobs

        c = self.cfg
        how = {"processed": {"temperature": c.temperature, "top_k": c.top_k or None, "top_p": c.top_p},
               "temperature": {"temperature": c.temperature}, "raw": {}}[c.trainer_logprobs]
        return recompute_logprobs(self.pushed if pushed else self.model, batch, **how).cpu()

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if token_id >= 0 else ""


def push_weights(model: torch.nn.Module, scale: float, seed: int) -> torch.nn.Module:
    """A copy of `model` whose matrices moved by N(0, (scale * std)^2): a stand-in for one optimizer step."""
    pushed = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in pushed.parameters():
            if p.dim() >= 2:  # noise drawn on the CPU: the same push on every device
                p.add_((torch.randn(p.shape, generator=gen) * (scale * float(p.std()))).to(p.device))
    return pushed


def engine_args_for(cfg: PreflightConfig, trainer: Trainer) -> dict[str, Any]:
    """The user's engine arguments with what a preflight needs filled in where the user set nothing."""
    longest = max(len(p) for p in trainer.prompts)
    return {"enforce_eager": True, "max_model_len": longest + cfg.max_tokens, "seed": cfg.seed,
            **cfg.engine_args, "model": str(cfg.model)}


def measure(trainer: Trainer, args: dict[str, Any], *, label: str, knob: str | None) -> Measurement:
    """Start an engine with `args`, sample, push, sample again, compare with the trainer; close it."""
    from rldiag.collectors.integrations.vllm import rollout_from_outputs
    from rldiag.collectors.integrations.vllm_engine import Engine
    from rldiag.collectors.metrics import logprob_mismatch

    cfg = trainer.cfg
    m = Measurement(label, knob, {k: v for k, v in args.items() if k != "model"})
    with Engine(args) as engine:
        m.fingerprint = dict(engine.fingerprint)
        why = _not_honoured(knob, args, m.fingerprint)
        if why:
            m.status, m.note = "not_honoured", why
            return m

        def sample() -> Any:
            return rollout_from_outputs(engine.generate(trainer.prompts, n=cfg.samples, max_tokens=cfg.max_tokens,
                                                        temperature=cfg.temperature, top_p=cfg.top_p,
                                                        top_k=cfg.top_k, seeds=trainer.seeds))

        before = sample()
        lp0 = trainer.logprobs(before, pushed=False)
        ok0 = before.mask & ~torch.isneginf(lp0)
        m.mean_before_push = float(logprob_mismatch(lp0, before.logprobs, ok0).logprob_abs_diff_mean)
        engine.load_weights(trainer.pushed, pause=False)  # nothing in flight: generate() returned finished outputs
        if cfg.reset_cache_on_push:
            engine.reset_prefix_cache()
        after = sample()
    fill(m, trainer, after)
    return m


def fill(m: Measurement, trainer: Trainer, batch: Any) -> None:
    """The parity numbers of one sampled batch, against the pushed trainer."""
    from rldiag.collectors.metrics import kl_new_old, logprob_mismatch, ratio_stats, token_mult_prob_error, worst_tokens

    lp_t, lp_e, mask = trainer.logprobs(batch), batch.logprobs, batch.mask
    outside = torch.isneginf(lp_t) & mask
    scored = mask & ~outside  # an infinite |d| would make every mean inf: counted on its own instead
    mm = logprob_mismatch(lp_t, lp_e, scored)
    m.tokens = int(mask.sum())
    m.mean, m.max = float(mm.logprob_abs_diff_mean), float(mm.logprob_abs_diff_max)
    m.token_mult_prob_error = float(token_mult_prob_error(lp_t, lp_e, scored))
    m.kl_k3 = float(kl_new_old(lp_t, lp_e, scored).k3)
    m.ratio_mean = float(ratio_stats(lp_t, lp_e, scored).mean)
    m.outside_trainer_support = int(outside.sum())
    first = batch.sample_index == 0  # one row per request: its prompt's cache hits
    m.cached_prompt_tokens = int(batch.num_cached_tokens[first].clamp(min=0).sum())
    w = worst_tokens(lp_t, lp_e, mask, token_ids=batch.token_ids, k=trainer.cfg.worst)
    for i in range(len(w.sample)):
        if int(w.sample[i]) < 0:
            break
        tid = int(w.token_id[i])
        m.worst.append({"sample": int(w.sample[i]), "prompt": int(batch.request_index[w.sample[i]]),
                        "position": int(w.position[i]), "token_id": tid, "token": trainer.token_text(tid),
                        "lp_trainer": float(w.lp_trainer[i]), "lp_engine": float(w.lp_engine[i]),
                        "abs_diff": float(w.abs_diff[i])})


FIXES: dict[str, str] = {
    "logprobs_mode": "start vLLM with logprobs_mode={value} (or score the trainer's tokens the way the engine does)",
    "prefix_caching": "disable prefix caching (enable_prefix_caching=False) or reset it after every weight push "
                      "(llm.reset_prefix_cache())",
    "dtype": "run the engine in {value}, or accept the mismatch and correct for it (importance sampling)",
    "lm_head_fp32": "load the engine's lm_head in float32 (hf_overrides={{'head_dtype': 'float32'}})",
    "async_scheduling": "set async_scheduling={value} (tokens sampled with stale weights otherwise)",
}


def run_preflight(cfg: PreflightConfig, *, progress: Callable[[str], None] = lambda _: None) -> PreflightResult:
    """The user's engine arguments, then each knob of `cfg.knobs` flipped alone; the verdict."""
    from rldiag.app.preflight.config import check_engine_arg_names

    check_engine_arg_names(cfg.engine_args)
    trainer = Trainer(cfg)
    args = engine_args_for(cfg, trainer)
    progress("baseline (your engine arguments)")
    base = measure(trainer, args, label="baseline", knob=None)
    notes: list[str] = []
    flips: list[Measurement] = []
    for knob in cfg.knobs:
        new, label, skip = flipped_args(knob, args, base.fingerprint)
        if new is None:
            flips.append(Measurement(label, knob, {}, status="skipped", note=skip))
            continue
        progress(label)
        flips.append(measure_flip(trainer, new, label=label, knob=knob))
    pair = pair_to_try(cfg, args, base, flips)
    if pair is not None:  # two causes at once (V1's defaults: raw logprobs and a prefix cache kept)
        progress(pair[1])
        flips.append(measure_flip(trainer, pair[0], label=pair[1], knob=pair[2]))
    notes += cache_notes(cfg, base, flips)
    return verdict(cfg, base, flips, notes)


COMBINED = "+"  # joins the knobs of a pair flipped together


def measure_flip(trainer: Trainer, args: dict[str, Any], *, label: str, knob: str) -> Measurement:
    """`measure`, where an engine that refuses the flipped setting is a result ("failed"), not a crash."""
    try:
        return measure(trainer, args, label=label, knob=knob)
    except Exception as e:  # noqa: BLE001 - e.g. a build that refuses hf_overrides head_dtype=float32
        first = (str(e).strip().splitlines() or [""])[0][:300]
        return Measurement(label, knob, {k: v for k, v in args.items() if k != "model"}, status="failed",
                           note=f"the engine did not start with this setting ({type(e).__name__}: {first})")


def _improves(m: Measurement, base: Measurement) -> bool:
    return m.status == "measured" and (m.mean < base.mean or m.outside_trainer_support < base.outside_trainer_support)


def pair_to_try(cfg: PreflightConfig, args: dict[str, Any], base: Measurement,
                flips: list[Measurement]) -> tuple[dict[str, Any], str, str] | None:
    """`(engine args, label, knob)` flipping the two most helpful knobs together, where the baseline fails
    and no single flip passes; None otherwise."""
    if base.passes(cfg.max_mismatch) or any(f.passes(cfg.max_mismatch) for f in flips):
        return None
    helping = sorted((f for f in flips if _improves(f, base)), key=lambda f: (f.mean, f.outside_trainer_support))
    if len(helping) < 2:
        return None
    a, b = helping[:2]
    merged = {**args, "model": args["model"]}
    for f in (a, b):
        merged.update({k: v for k, v in f.engine_args.items() if args.get(k) != v})
    return merged, f"{a.label} + {b.label}", f"{a.knob}{COMBINED}{b.knob}"


def cache_notes(cfg: PreflightConfig, base: Measurement, flips: list[Measurement]) -> list[str]:
    """Say when the prefix-cache knob could not show anything (no prompt token came from the cache)."""
    with_cache = [m for m in [base, *flips] if m.status == "measured" and m.fingerprint.get(_FP_CACHE) == "True"]
    if with_cache and all(m.cached_prompt_tokens == 0 for m in with_cache):
        block = with_cache[0].fingerprint.get(_FP_BLOCK, "?")
        return [(f"prefix caching: no prompt token came from the cache after the weight push (prompts of "
                f"{cfg.prompt_len} tokens, KV block {block}): cannot tell whether caching across a push matters; "
                f"use a --prompt-len above the block size")]
    return []


def verdict(cfg: PreflightConfig, base: Measurement, flips: list[Measurement], notes: list[str]) -> PreflightResult:
    thr = cfg.max_mismatch
    passed = base.passes(thr)
    explained_by = fix = None
    gap = f"mean |Δ logprob| {base.mean:.3g}" + (
        f", {base.outside_trainer_support} sampled token(s) outside the trainer's support"
        if base.outside_trainer_support else "")
    if passed:
        line = f"PASS: {gap} <= --max-mismatch {thr:g}: the engine matches the trainer at equal weights"
    else:
        line = f"FAIL: {gap} (--max-mismatch {thr:g})"
        # a single knob first; a pair (COMBINED) only where no single knob closes the gap
        fixing = sorted((m for m in flips if m.passes(thr)), key=lambda m: (COMBINED in m.knob, m.mean))
        measured = sorted((m for m in flips if m.status == "measured"), key=lambda m: m.mean)
        if fixing:
            best = fixing[0]
            knobs, values = best.knob.split(COMBINED), [p.split(" -> ")[-1] for p in best.label.split(" + ")]
            explained_by = best.knob
            fix = "; ".join(FIXES[k].format(value=v) for k, v in zip(knobs, values))
            who = f"{knobs[0]} explains" if len(knobs) == 1 else f"{' and '.join(knobs)} together explain"
            line += (f"; {who} the gap: {best.label} brings the mean from {base.mean:.3g} "
                     f"to {best.mean:.3g}. Fix: {fix}")
        elif measured and measured[0].mean < base.mean:
            line += (f"; no single knob explains the gap: the largest reduction is {measured[0].label} "
                     f"(mean {base.mean:.3g} -> {measured[0].mean:.3g})")
        else:
            line += "; no knob flipped here reduces it (the model, the sampling transform or the trainer's recompute?)"
    unmeasured = [f"{m.label}: {m.note}" for m in flips if m.status != "measured"]
    notes = [*notes, *unmeasured]
    return PreflightResult(config=config_dict(cfg), baseline=base, flips=flips, passed=passed, verdict=line,
                           explained_by=explained_by, fix=fix, notes=notes)


def config_dict(cfg: PreflightConfig) -> dict[str, Any]:
    from dataclasses import asdict

    return {k: (str(v) if hasattr(v, "__fspath__") else v) for k, v in asdict(cfg).items()}


__all__ = ["Measurement", "PreflightResult", "flipped_args", "push_weights", "run_preflight", "verdict"]
