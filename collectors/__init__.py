"""rldiag's write side: per-step RL diagnostics and non-finite gradient alerts, logged to MLflow.

Light to import: each public name loads its module on first use (`rldiag.collectors.keys` needs no torch);
the metrics and the gradient check load torch, and mlflow loads when a `Monitor` opens a run.
"""

from typing import TYPE_CHECKING

from rldiag.collectors.lazy import lazy_exports

# name -> the module that defines it; loaded on first use, so that `rldiag.collectors.keys` (all the read side
# needs) imports without torch, and `from rldiag.collectors import Monitor` loads only what Monitor needs.
_EXPORTS: dict[str, str] = {
    "AlertDispatcher": "rldiag.collectors.alerts",
    "JsonlSink": "rldiag.collectors.alerts",
    "LoggingSink": "rldiag.collectors.alerts",
    "NonFiniteGradAlert": "rldiag.collectors.alerts",
    "WebhookSink": "rldiag.collectors.alerts",
    "GradReport": "rldiag.collectors.gradcheck",
    "LogitsProbe": "rldiag.collectors.gradcheck",
    "check_gradients": "rldiag.collectors.gradcheck",
    "clip_active_rate": "rldiag.collectors.metrics",
    "clip_rate": "rldiag.collectors.metrics",
    "entropy_from_logits": "rldiag.collectors.metrics",
    "kl_new_old": "rldiag.collectors.metrics",
    "logprob_mismatch": "rldiag.collectors.metrics",
    "policy_metrics": "rldiag.collectors.metrics",
    "ratio_stats": "rldiag.collectors.metrics",
    "reward_stats": "rldiag.collectors.metrics",
    "sequence_clip_rate": "rldiag.collectors.metrics",
    "to_host": "rldiag.collectors.metrics",
    "Monitor": "rldiag.collectors.monitor",
    "NonFiniteGradientError": "rldiag.collectors.monitor",
    "MetricWriter": "rldiag.collectors.writer",
}

if TYPE_CHECKING:  # what static tools see; at run time __getattr__ below loads each name on first use
    from rldiag.collectors.alerts import AlertDispatcher, JsonlSink, LoggingSink, NonFiniteGradAlert, WebhookSink
    from rldiag.collectors.gradcheck import GradReport, LogitsProbe, check_gradients
    from rldiag.collectors.metrics import (
        clip_active_rate,
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
    from rldiag.collectors.monitor import Monitor, NonFiniteGradientError
    from rldiag.collectors.writer import MetricWriter


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
    "clip_active_rate",
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

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
