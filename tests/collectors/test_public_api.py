"""The package's public surface: a pinned `__all__`, and an import that stays light."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import rldiag.collectors

REPO = Path(__file__).resolve().parents[2]

EXPECTED_ALL = [
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


def test_all_is_pinned():
    # Adding or removing a public name is a deliberate change: update this list with it.
    assert sorted(rldiag.collectors.__all__) == EXPECTED_ALL
    assert len(set(rldiag.collectors.__all__)) == len(rldiag.collectors.__all__)


def test_every_public_name_loads_from_its_module():
    for name in rldiag.collectors.__all__:
        assert getattr(rldiag.collectors, name).__module__.startswith("rldiag.collectors."), name
    assert set(rldiag.collectors.__all__) <= set(dir(rldiag.collectors))
    with pytest.raises(AttributeError, match="no attribute 'Monitr'"):
        rldiag.collectors.Monitr  # noqa: B018 - a typo must fail as loudly as with eager imports


def _loaded_after(statement: str) -> dict:
    code = (
        "import json, sys\n"
        f"{statement}\n"
        "heavy = ('mlflow', 'transformers', 'vllm', 'streamlit', 'torch')\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules if m.split('.')[0] in heavy})))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_collectors_loads_no_heavy_dependency():
    # `import rldiag` and the keys (what the read side needs of the collectors) load nothing heavy
    assert _loaded_after("import rldiag, rldiag.collectors, rldiag.collectors.keys") == []
    # the training side: torch, the one heavy import the collectors are allowed; mlflow when a run opens
    assert _loaded_after("from rldiag.collectors import Monitor, policy_metrics, check_gradients") == ["torch"]
    assert _loaded_after("from rldiag import Monitor, policy_metrics") == ["torch"]


def test_top_level_namespace_is_pinned():
    import rldiag

    assert sorted(rldiag.__all__) == ["Monitor", "NonFiniteGradientError", "RldiagCallback", "policy_metrics"]
    assert rldiag.Monitor is rldiag.collectors.Monitor
    assert rldiag.policy_metrics is rldiag.collectors.policy_metrics
    from rldiag.collectors.integrations.transformers import RldiagCallback

    assert rldiag.RldiagCallback is RldiagCallback
    with pytest.raises(AttributeError, match="module 'rldiag' has no attribute 'Monitr'"):
        rldiag.Monitr  # noqa: B018
