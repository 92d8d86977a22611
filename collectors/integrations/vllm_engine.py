"""A real vLLM engine for parity checks: environment, start/stop, weight push, sampling.

Used by the engine-parity experiment and `rldiag preflight`. vLLM is imported inside the functions
that need it. `ENGINE_ENV` holds the environment that an engine needs on a CPU-only machine
(variables the user has set win); on a CUDA machine it is harmless.

    engine = Engine(engine_kwargs(model_dir, EngineConfig(), max_model_len=96))
    outputs = engine.generate(prompt_ids, n=2, max_tokens=16, temperature=0.7, top_p=0.9, seeds=[0, 1])
    engine.load_weights(model, pause=True)       # push the trainer's weights
    engine.close()
"""

from __future__ import annotations

import gc
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import torch

ENGINE_ENV: dict[str, str] = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the CPU default asks for most of the machine's memory
    "TORCHDYNAMO_DISABLE": "1",  # with enforce_eager: no 15-40 s compile at the first generate
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # a weight push passes a function closing over tensors
    "VLLM_LOGGING_LEVEL": "WARNING",  # keep the progress bars readable
    "TOKENIZERS_PARALLELISM": "false",
}
# In-process engine (no engine-core process): starts in 2-7 s instead of ~20 s on a CPU, generates slower.
IN_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
BLOCK_SIZE = 32  # KV block; short prompts then hit the prefix cache (the CPU default is 128)


@dataclass(frozen=True)
class EngineConfig:
    """The parity knobs an engine is started with; one engine serves every run whose EngineConfig is equal."""

    logprobs_mode: str = "processed_logprobs"  # raw_logprobs (V1 default) | processed_logprobs (V0 semantics)
    enable_prefix_caching: bool = False  # V1 default True
    async_scheduling: bool = False  # requested; the CPU build forces it off (engine.async_scheduling says so)
    dtype: str = "float32"  # engine weights and activations: float32 | bfloat16
    lm_head_fp32: bool = False  # hf_overrides head_dtype=float32: the lm_head projection in float32

    def label(self) -> str:
        """A short name for progress output, e.g. `processed/no-cache/float32`."""
        head = "+fp32-head" if self.lm_head_fp32 else ""
        cache = "cache" if self.enable_prefix_caching else "no-cache"
        return f"{self.logprobs_mode.removesuffix('_logprobs')}/{cache}/{self.dtype}{head}"


def set_engine_env(*, in_process: bool = False) -> None:
    """Set `ENGINE_ENV` (and `IN_PROCESS_ENV`) where the user has not; call before the first `import vllm`."""
    for name, value in {**ENGINE_ENV, **(IN_PROCESS_ENV if in_process else {})}.items():
        os.environ.setdefault(name, value)


def engine_kwargs(model_dir: str | Path, cfg: EngineConfig, *, max_model_len: int, seed: int = 0) -> dict[str, Any]:
    """The `vllm.LLM(...)` keyword arguments for `cfg` (also what `engine_fingerprint` records as requested)."""
    kwargs: dict[str, Any] = {
        "model": str(model_dir), "dtype": cfg.dtype, "logprobs_mode": cfg.logprobs_mode,
        "enable_prefix_caching": cfg.enable_prefix_caching, "async_scheduling": cfg.async_scheduling,
        "enforce_eager": True, "block_size": BLOCK_SIZE, "max_model_len": max_model_len, "seed": seed,
    }
    if cfg.lm_head_fp32:
        kwargs["hf_overrides"] = {"head_dtype": "float32"}
    return kwargs


class Engine:
    """A started `vllm.LLM` with the keyword arguments it was given; `close()` ends it (also on `with` exit)."""

    def __init__(self, requested: Mapping[str, Any]):
        set_engine_env()
        from vllm import LLM

        from rldiag.collectors.integrations.vllm import engine_fingerprint

        self.requested = dict(requested)
        self.llm = LLM(**self.requested)
        self.fingerprint = engine_fingerprint(self.llm, requested=self.requested)

    def lm_head_dtype(self) -> str:
        """What the engine's lm_head projection runs in (after vLLM's platform checks)."""
        return self.fingerprint["engine.lm_head_dtype"]

    def load_weights(self, model: torch.nn.Module, *, pause: bool) -> None:
        """Copy `model`'s weights into the engine (vLLM's in-place `reload_weights`, FACTS-vllm-cpu.md).

        `pause`: pause scheduling around the load (`sleep(level=0)` / `wake_up(["scheduling"])`), as
        V0 loaded weights at an engine boundary. The prefix cache is kept: see `reset_prefix_cache`.
        """
        # cast here to what the engine runs: vLLM warns for every float32 tensor it downcasts
        dtype = getattr(torch, self.fingerprint["engine.dtype"])
        items = [(name, t.detach().to("cpu", dtype=dtype if t.is_floating_point() else t.dtype, copy=True))
                 for name, t in model.state_dict().items()]

        def load(worker: Any) -> None:  # runs in the engine's worker (process)
            worker.reload_weights(weights_iterator=iter(items))

        if pause:
            self.llm.sleep(level=0, mode="wait")
        try:
            self.llm.collective_rpc(load)
        finally:
            if pause:
                self.llm.wake_up(tags=["scheduling"])

    def reset_prefix_cache(self) -> None:
        """Forget every cached KV block (needed after a weight load when prefix caching is on)."""
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset the prefix cache (requests still running?)")

    def generate(self, prompts: list[list[int]], *, n: int, max_tokens: int, temperature: float, top_p: float,
                 seeds: list[int], top_k: int = 0) -> list[Any]:
        """`n` completions of exactly `max_tokens` tokens per prompt (token ids in, finished outputs out).

        `top_k=0`: no top-k (vLLM's spelling). One seed per prompt makes the samples reproducible.
        """
        from vllm import SamplingParams

        params = [SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                 logprobs=0, seed=s, ignore_eos=True, detokenize=False) for s in seeds]
        return self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    def close(self) -> None:
        from rldiag.collectors.integrations.vllm import shutdown_engine

        shutdown_engine(self.llm)
        del self.llm
        gc.collect()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["BLOCK_SIZE", "ENGINE_ENV", "IN_PROCESS_ENV", "Engine", "EngineConfig", "engine_kwargs", "set_engine_env"]
