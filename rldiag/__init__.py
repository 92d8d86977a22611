"""rldiag: diagnostics for LLM RL training runs (GRPO, GSPO, PPO, on-policy distillation) on MLflow.

    from rldiag import Monitor, policy_metrics            # the training side (rldiag.collectors)
    from rldiag import RldiagCallback                     # transformers / TRL trainers (extra: hf)
    import rldiag.app                                     # the read side (extra: app)

Importing `rldiag` loads nothing else: each name below loads its module on first use.

The repository keeps three folders, `collectors/`, `app/`, `experiments/`; the build installs them
as `rldiag.collectors`, `rldiag.app`, `rldiag.experiments` (pyproject's package-dir), and never as
bare top-level packages.
"""

from typing import TYPE_CHECKING

from rldiag.collectors.lazy import lazy_exports

__version__ = "0.2.0"

_EXPORTS: dict[str, str] = {
    "Monitor": "rldiag.collectors.monitor",
    "NonFiniteGradientError": "rldiag.collectors.monitor",
    "policy_metrics": "rldiag.collectors.metrics",
    "RldiagCallback": "rldiag.collectors.integrations.transformers",
}

if TYPE_CHECKING:  # what static tools see
    from rldiag.collectors.integrations.transformers import RldiagCallback
    from rldiag.collectors.metrics import policy_metrics
    from rldiag.collectors.monitor import Monitor, NonFiniteGradientError

__all__ = ["Monitor", "NonFiniteGradientError", "RldiagCallback", "policy_metrics"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
