"""rldiag's write side: per-step RL diagnostics and non-finite gradient alerts, logged to MLflow.

Light to import: each public name loads its module on first use (`collectors.keys` needs no torch);
the metrics and the gradient check load torch, and mlflow loads when a `Monitor` opens a run.
"""

import importlib
from typing import TYPE_CHECKING

# name -> the module that defines it; loaded on first use, so that `collectors.keys` (all the read side
# needs) imports without torch, and `from collectors import Monitor` loads only what Monitor needs.
_EXPORTS: dict[str, str] = {
    "AlertDispatcher": "collectors.alerts",
    "JsonlSink": "collectors.alerts",
    "LoggingSink": "collectors.alerts",
    "NonFiniteGradAlert": "collectors.alerts",
    "WebhookSink": "collectors.alerts",
    "GradReport": "collectors.gradcheck",
    "LogitsProbe": "collectors.gradcheck",
    "check_gradients": "collectors.gradcheck",
    "clip_rate": "collectors.metrics",
    "entropy_from_logits": "collectors.metrics",
    "kl_new_old": "collectors.metrics",
    "logprob_mismatch": "collectors.metrics",
    "policy_metrics": "collectors.metrics",
    "ratio_stats": "collectors.metrics",
    "reward_stats": "collectors.metrics",
    "sequence_clip_rate": "collectors.metrics",
    "to_host": "collectors.metrics",
    "Monitor": "collectors.monitor",
    "NonFiniteGradientError": "collectors.monitor",
    "MetricWriter": "collectors.writer",
}

if TYPE_CHECKING:  # what static tools see; at run time __getattr__ below loads each name on first use
    from collectors.alerts import AlertDispatcher, JsonlSink, LoggingSink, NonFiniteGradAlert, WebhookSink
    from collectors.gradcheck import GradReport, LogitsProbe, check_gradients
    from collectors.metrics import (
        clip_rate,
        entropy_from_logits,
        kl_new_old,
        logprob_mismatch,
        policy_metrics,
        ratio_stats,
        reward_stats,
        sequence_clip_rate,
        to_host,
    )
    from collectors.monitor import Monitor, NonFiniteGradientError
    from collectors.writer import MetricWriter


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'collectors' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "AlertDispatcher",
    "GradReport",
    "JsonlSink",
    "LoggingSink",
    "LogitsProbe",
    "MetricWriter",
    "Monitor",
    "NonFiniteGradAlert",
    "NonFiniteGradientError",
    "WebhookSink",
    "check_gradients",
    "clip_rate",
    "entropy_from_logits",
    "kl_new_old",
    "logprob_mismatch",
    "policy_metrics",
    "ratio_stats",
    "reward_stats",
    "sequence_clip_rate",
    "to_host",
]
