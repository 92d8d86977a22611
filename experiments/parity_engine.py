"""The vLLM side of the engine-parity experiment: engine settings, start/stop, weight sync, sampling.

vLLM is imported inside the functions that need it. `ENGINE_ENV` holds the environment that a real
engine needs on a CPU-only machine (FACTS-vllm-cpu.md); `start_engine` sets it, so a user running the
experiment needs nothing extra (variables already set by the user win).
"""

from __future__ import annotations

import gc
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

ENGINE_ENV: dict[str, str] = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the CPU default asks for most of the machine's memory
    "TORCHDYNAMO_DISABLE": "1",  # with enforce_eager: no 15-40 s compile at the first generate
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # weight sync passes a function closing over tensors
    "VLLM_LOGGING_LEVEL": "WARNING",  # keep the progress bars readable
    "TOKENIZERS_PARALLELISM": "false",
}
BLOCK_SIZE = 32  # KV block; short prompts then hit the prefix cache (the CPU default is 128)


@dataclass(frozen=True)
class EngineConfig:
    """What the engine is started with; one engine serves every run whose EngineConfig is equal."""

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


def set_engine_env() -> None:
    """Set `ENGINE_ENV` where the user has not set a value; call before the first `import vllm`."""
    for name, value in ENGINE_ENV.items():
        os.environ.setdefault(name, value)


def engine_kwargs(model_dir: str | Path, cfg: EngineConfig, *, max_model_len: int, seed: int = 0) -> dict[str, Any]:
    """The `vllm.LLM(...)` keyword arguments for `cfg` (also what `engine_fingerprint` records as requested)."""
    kwargs: dict[str, Any] = dict(
        model=str(model_dir), dtype=cfg.dtype, logprobs_mode=cfg.logprobs_mode,
        enable_prefix_caching=cfg.enable_prefix_caching, async_scheduling=cfg.async_scheduling,
        enforce_eager=True, block_size=BLOCK_SIZE, max_model_len=max_model_len, seed=seed,
    )
    if cfg.lm_head_fp32:
        kwargs["hf_overrides"] = {"head_dtype": "float32"}
    return kwargs


class Engine:
    """A started `vllm.LLM` with its settings; `close()` ends its processes (also on `with` exit)."""

    def __init__(self, model_dir: str | Path, cfg: EngineConfig, *, max_model_len: int):
        set_engine_env()
        from vllm import LLM

        from rldiag.collectors.integrations.vllm import engine_fingerprint

        self.cfg = cfg
        self.requested = engine_kwargs(model_dir, cfg, max_model_len=max_model_len)
        self.llm = LLM(**self.requested)
        self.fingerprint = engine_fingerprint(self.llm, requested=self.requested)
        self.fingerprint["engine.lm_head_fp32.requested"] = str(cfg.lm_head_fp32)

    def lm_head_dtype(self) -> str:
        """What the engine's lm_head projection runs in (after vLLM's platform checks)."""
        return self.fingerprint["engine.lm_head_dtype"]

    def load_weights(self, model: torch.nn.Module, *, pause: bool) -> None:
        """Copy `model`'s weights into the engine (vLLM's in-place `reload_weights`, FACTS-vllm-cpu.md).

        `pause`: pause scheduling around the load (`sleep(level=0)` / `wake_up(["scheduling"])`), as
        V0 loaded weights at an engine boundary. The prefix cache is kept: see `reset_prefix_cache`.
        """
        dtype = getattr(torch, self.cfg.dtype)  # cast here: vLLM warns for every float32 tensor it downcasts
        items = [(name, t.detach().to("cpu", dtype=dtype if t.is_floating_point() else t.dtype, copy=True))
                 for name, t in model.state_dict().items()]

        def load(worker: Any) -> None:  # runs in the engine's worker process
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
                 seeds: list[int]) -> list[Any]:
        """`n` completions of exactly `max_tokens` tokens per prompt (token ids in, finished outputs out)."""
        from vllm import SamplingParams

        params = [SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature, top_p=top_p, logprobs=0,
                                 seed=s, ignore_eos=True, detokenize=False) for s in seeds]
        return self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    def close(self) -> None:
        from rldiag.collectors.integrations.vllm import shutdown_engine

        shutdown_engine(self.llm)
        del self.llm
        gc.collect()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def config_params(cfg: EngineConfig) -> dict[str, str]:
    """`cfg` as string params (`variant.engine.*` in the run)."""
    return {k: str(v) for k, v in asdict(cfg).items()}


__all__ = ["BLOCK_SIZE", "ENGINE_ENV", "Engine", "EngineConfig", "config_params", "engine_kwargs", "set_engine_env"]
