"""rldiag's write side: per-step RL diagnostics and non-finite gradient alerts, logged to MLflow.

Imports torch and numpy only; mlflow loads when a `Monitor` opens a run.
"""

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
