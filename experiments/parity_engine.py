"""The vLLM side of the engine-parity experiment: its engine settings, on the shared engine driver.

The engine itself (environment, start/stop, weight push, sampling) lives in
`rldiag.collectors.integrations.vllm_engine`, which `rldiag preflight` uses too; this module keeps what
only the experiment needs: starting an engine from an `EngineConfig` and the config as run params.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from rldiag.collectors.integrations.vllm_engine import (
    BLOCK_SIZE,
    ENGINE_ENV,
    Engine,
    EngineConfig,
    engine_kwargs,
    set_engine_env,
)


def start_engine(model_dir: str | Path, cfg: EngineConfig, *, max_model_len: int) -> Engine:
    """A started engine for `cfg`; its fingerprint also records whether an fp32 lm_head was asked for."""
    engine = Engine(engine_kwargs(model_dir, cfg, max_model_len=max_model_len))
    engine.fingerprint["engine.lm_head_fp32.requested"] = str(cfg.lm_head_fp32)
    return engine


def config_params(cfg: EngineConfig) -> dict[str, str]:
    """`cfg` as string params (`variant.engine.*` in the run)."""
    return {k: str(v) for k, v in asdict(cfg).items()}


__all__ = ["BLOCK_SIZE", "ENGINE_ENV", "Engine", "EngineConfig", "config_params", "engine_kwargs", "set_engine_env",
           "start_engine"]
