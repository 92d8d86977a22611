"""What the likely causes read from a run's params: the engine fingerprint (`engine.*`, written by
`rldiag.collectors.integrations.vllm.engine_fingerprint`), the sampling settings, batch x
accumulation, dtypes, optimizer settings, and how a candidate's params differ from its references'.

Names are matched on their last dotted part, so `loop.temperature` (rldiag's experiments),
`trainer.temperature` (RldiagCallback) and `temperature` (transformers' own MLflow logging) all count.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Mapping, Sequence

ENGINE = "engine."
# Params that differ between seeds of one configuration, or between any two runs, without meaning.
_RUN_SPECIFIC = re.compile(r"seed|output_dir|logging_dir|run_name|run_id|hub_|push_to_hub|^model$|\.model$",
                           re.IGNORECASE)
_OPTIMIZER = re.compile(r"^(lr|learning_rate|lr_scale|eps_low|eps_high|epsilon|epsilon_high|epsilon_low|cliprange\w*|"
                        r"clip_range\w*|clip_ratio\w*|max_grad_norm|weight_decay|adam_\w+|warmup\w*|"
                        r"lr_scheduler_type|optim|beta|kl_coef|init_kl_coef)$", re.IGNORECASE)
_BITS = {"float64": 64, "double": 64, "float32": 32, "float": 32, "tf32": 19, "bfloat16": 16, "bf16": 16,
         "float16": 16, "half": 16, "fp16": 16, "fp8": 8, "float8_e4m3fn": 8, "int8": 8, "int4": 4}
BATCH_NAMES = ("batch_size", "per_device_train_batch_size", "micro_batch_size", "train_micro_batch_size_per_gpu",
               "ppo_micro_batch_size_per_gpu")
ACCUMULATION_NAMES = ("accumulation", "gradient_accumulation_steps", "grad_accum")


def last(name: str) -> str:
    return name.rsplit(".", 1)[-1].lower()


def find(params: Mapping[str, str], names: Sequence[str], *, engine: bool = False) -> tuple[str, str] | None:
    """The first param whose last dotted part is one of `names` (outside `engine.*` unless `engine`)."""
    for want in names:
        for k, v in params.items():
            if last(k) == want and k.startswith(ENGINE) == engine:
                return k, v
    return None


def has_fingerprint(params: Mapping[str, str]) -> bool:
    """The run logged an engine fingerprint (`engine.*` params)."""
    return any(k.startswith(ENGINE) for k in params)


def number(v: object) -> float | None:
    """`v` as a finite float, or None ("None", "auto", "", NaN, inf, a list: not a number)."""
    try:
        x = float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return None
    return x if math.isfinite(x) else None


def sampling(params: Mapping[str, str]) -> dict[str, float]:
    """The sampling settings the run logged that change the sampled distribution (temperature != 1,
    top_p < 1, top_k > 0), e.g. {"temperature": 0.7, "top_p": 0.9}."""
    out = {}
    for name, neutral in (("temperature", lambda x: x == 1.0), ("top_p", lambda x: x >= 1.0),
                          ("top_k", lambda x: x <= 0)):
        hit = find(params, (name,))
        x = number(hit[1]) if hit else None
        if x is not None and not neutral(x):
            out[name] = x
    return out


def sampling_known(params: Mapping[str, str]) -> bool:
    return find(params, ("temperature",)) is not None


def batch_x_accumulation(params: Mapping[str, str]) -> tuple[int, str] | None:
    """(batch x accumulation, "batch_size=2 x accumulation=1"), or None when the run logged neither as a
    number; a missing partner counts as 1 ("batch_size=4": distillation runs log no accumulation)."""
    found = [hit for hit in (find(params, BATCH_NAMES), find(params, ACCUMULATION_NAMES)) if hit is not None]
    nums = [number(v) for _, v in found]
    n = math.prod(nums) if found and None not in nums else math.nan  # type: ignore[arg-type]
    return (int(n), " x ".join(f"{last(k)}={v}" for k, v in found)) if math.isfinite(n) else None


def batch_unread(params: Mapping[str, str]) -> str:
    """Why `batch_x_accumulation` is None: "batch_size=auto is not a number", or "the run logged no ..."."""
    for k, v in (hit for hit in (find(params, BATCH_NAMES), find(params, ACCUMULATION_NAMES)) if hit):
        if number(v) is None:
            return f"{k}={v} is not a number"
    return "the run logged no batch size or accumulation"


def bits(dtype: str | None) -> int | None:
    return _BITS.get(str(dtype).lower().removeprefix("torch.")) if dtype else None


def trainer_dtype(params: Mapping[str, str]) -> tuple[str, str] | None:
    """The trainer's dtype param (`model.dtype`, `torch_dtype`, ...): none that names the engine."""
    return find({k: v for k, v in params.items() if "engine" not in k.lower()}, ("dtype", "torch_dtype"))


def reference_value(refs: Sequence[Mapping[str, str]], key: str) -> str | None:
    """The value most references hold for `key` (None: none has it)."""
    vals = [r[key] for r in refs if key in r]
    return Counter(vals).most_common(1)[0][0] if vals else None


def differing(params: Mapping[str, str], refs: Sequence[Mapping[str, str]]) -> dict[str, tuple[str | None, str | None]]:
    """`{key: (candidate value, references' value)}` for the params that differ, run-specific ones
    (seeds, output folders, model paths) left out; a key only one side has differs too."""
    out = {}
    for k in sorted(set(params) | {k for r in refs for k in r}):
        if _RUN_SPECIFIC.search(k):
            continue
        mine, theirs = params.get(k), reference_value(refs, k)
        if mine != theirs:
            out[k] = (mine, theirs)
    return out


def optimizer_diffs(diffs: Mapping[str, tuple[str | None, str | None]]) -> dict[str, tuple[str | None, str | None]]:
    return {k: v for k, v in diffs.items() if not k.startswith(ENGINE) and _OPTIMIZER.match(last(k))}


def vs(key: str, pair: tuple[str | None, str | None]) -> str:
    """ "engine.logprobs_mode raw_logprobs vs processed_logprobs" (the reference's value second)."""
    mine, theirs = pair
    return f"{key} {mine if mine is not None else '(not set)'} vs {theirs if theirs is not None else '(not set)'}"


def also_differs(params: Mapping[str, str], diffs: Mapping[str, tuple[str | None, str | None]],
                 cited: set[str]) -> tuple[str, ...]:
    """Engine settings that differ from the references' and no cause used. A `.requested` knob is said
    only where the engine runs otherwise ("requested True, in effect False": the build overrode it)."""
    out = []
    for k, v in diffs.items():
        if not k.startswith(ENGINE) or k in cited or k in ("engine.model", "engine.seed"):
            continue
        if k.endswith(".requested"):
            base = k.removesuffix(".requested")
            if base in diffs or base in cited or base not in params:
                continue
            out.append(f"{base} requested {v[0]} (the references: {v[1]}), in effect {params[base]} on this build")
        else:
            out.append(vs(k, v))
    return tuple(out)
