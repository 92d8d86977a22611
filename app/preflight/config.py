"""What `rldiag preflight` checks: the model, the engine arguments, the sampling settings, the knobs.

Everything here is validated before any engine starts, so bad input costs no engine start-up.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The knobs re-run one at a time against the user's engine arguments (DESIGN.md, "Likely causes").
KNOBS: dict[str, str] = {
    "logprobs_mode": "raw vs processed logprobs (before/after temperature, top-k, top-p)",
    "prefix_caching": "prefix caching across a weight push (KV computed with the old weights reused)",
    "dtype": "the engine's weights and activations (float32 vs bfloat16)",
    "lm_head_fp32": "the lm_head projection in float32 (hf_overrides head_dtype=float32)",
    "async_scheduling": "async scheduling (tokens scheduled before the previous step's output is known)",
}
# How the trainer turns logits into the logprobs it compares with the engine's.
TRAINER_LOGPROBS: dict[str, str] = {
    "processed": "log_softmax(top_k_top_p(logits / T)): vLLM's processed_logprobs (PipelineRL, V0 semantics)",
    "temperature": "log_softmax(logits / T): temperature only (TRL, verl)",
    "raw": "log_softmax(logits): no sampling transform (vLLM's raw_logprobs)",
}


@dataclass(frozen=True)
class PreflightConfig:
    """One preflight check; `engine_args` are `vllm.LLM(...)` keyword arguments other than `model`."""

    model: Path  # a directory transformers and vLLM both load (config.json, weights, tokenizer)
    engine_args: dict[str, Any] = field(default_factory=dict)  # the user's engine arguments, as given
    temperature: float = 1.0  # sampling temperature (> 0)
    top_p: float = 1.0  # nucleus sampling, (0, 1]
    top_k: int = 0  # 0: no top-k
    trainer_logprobs: str = "processed"  # how the trainer scores tokens (TRAINER_LOGPROBS)
    num_prompts: int = 8  # prompts sampled per engine
    samples: int = 2  # completions per prompt
    prompt_len: int = 64  # tokens of each random prompt (above the KV block size, so the prefix cache can hit)
    max_tokens: int = 16  # tokens per completion (eos ignored)
    prompts_file: Path | None = None  # one text prompt per line instead of random token prompts
    knobs: tuple[str, ...] = tuple(KNOBS)  # knobs to flip, one engine each
    max_mismatch: float = 0.01  # the gate: mean |lp_trainer - lp_engine| above it fails (exit 1)
    push_scale: float = 0.01  # the weight push: each matrix + N(0, (push_scale * its std)^2)
    reset_cache_on_push: bool = False  # whether the user's trainer resets vLLM's prefix cache after a push
    worst: int = 5  # worst tokens to list
    seed: int = 0  # prompts, sampling seeds and the weight push
    trainer_device: str = "cpu"  # where the float32 recompute runs ("cuda": leave vLLM room, gpu_memory_utilization)

    def __post_init__(self) -> None:
        if not (self.model / "config.json").is_file():
            what = "does not exist" if not self.model.exists() else "has no config.json"
            raise ValueError(f"--model {self.model}: {what}; give a directory saved with save_pretrained "
                             "(config.json, weights and tokenizer), loadable by transformers and vLLM")
        if "model" in self.engine_args:
            raise ValueError(f"engine argument model={self.engine_args['model']!r}: give the model with --model only")
        if not self.temperature > 0:
            raise ValueError(f"--temperature {self.temperature}: greedy sampling has no distribution to compare; use > 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p {self.top_p}: must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"--top-k {self.top_k}: 0 (no top-k) or a positive number of tokens")
        if self.trainer_logprobs not in TRAINER_LOGPROBS:
            raise ValueError(f"--trainer-logprobs {self.trainer_logprobs!r}: one of {', '.join(TRAINER_LOGPROBS)}")
        unknown = [k for k in self.knobs if k not in KNOBS]
        if unknown:
            raise ValueError(f"unknown knob {', '.join(map(repr, unknown))}; allowed: {', '.join(KNOBS)} (or none)")
        for name in ("num_prompts", "samples", "prompt_len", "max_tokens", "worst"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be at least 1")
        if not re.fullmatch(r"cpu|mps|(cuda|xpu)(:\d+)?", self.trainer_device):
            raise ValueError(f"--trainer-device {self.trainer_device!r}: cpu, cuda, cuda:N (or mps, xpu)")
        if self.prompts_file is not None and not self.prompts_file.is_file():
            raise ValueError(f"--prompts-file {self.prompts_file}: no such file (one prompt per line)")


def _key(name: str) -> str:
    return name.strip().replace("-", "_")


def load_engine_args(path: Path) -> dict[str, Any]:
    """Engine arguments from a YAML or JSON file holding one mapping (`vllm serve --config` style)."""
    import yaml

    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"--engine-args {path}: cannot read it ({e.strerror or e})") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--engine-args {path}: not valid JSON at line {e.lineno}: {e.msg}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ValueError(f"--engine-args {path}: not valid YAML{where}: {getattr(e, 'problem', None) or e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--engine-args {path}: expected a mapping of engine arguments "  # noqa: TRY004 - user input: one line, exit 2
                         f"(e.g. 'logprobs_mode: processed_logprobs'), got a {type(data).__name__}")
    return {_key(str(k)): v for k, v in data.items()}


def parse_engine_arg(item: str) -> tuple[str, Any]:
    """`KEY=VALUE` from the command line; VALUE is read as YAML (`true`, `0.9`, `{head_dtype: float32}`)."""
    import yaml

    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--engine-arg {item!r}: expected KEY=VALUE, e.g. --engine-arg logprobs_mode=processed_logprobs")
    try:
        return _key(key), yaml.safe_load(value)
    except yaml.YAMLError:
        return _key(key), value


def check_engine_arg_names(args: dict[str, Any]) -> None:
    """Every key must be a `vllm.EngineArgs` field (needs vLLM); one line naming the unknown ones."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    known = {f.name for f in dataclasses.fields(EngineArgs)}
    unknown = sorted(k for k in args if k not in known)
    if unknown:
        raise ValueError(f"unknown engine argument {', '.join(map(repr, unknown))}: not a field of "
                         f"vllm.EngineArgs in vLLM {_vllm_version()} (spell them as LLM(...) keywords)")


def _vllm_version() -> str:
    import vllm

    return vllm.__version__


__all__ = ["KNOBS", "TRAINER_LOGPROBS", "PreflightConfig", "check_engine_arg_names", "load_engine_args",
           "parse_engine_arg"]
