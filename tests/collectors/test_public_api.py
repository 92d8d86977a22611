"""The package's public surface: a pinned `__all__`, and an import that stays light."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import collectors

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
    assert sorted(collectors.__all__) == EXPECTED_ALL
    assert len(set(collectors.__all__)) == len(collectors.__all__)


def test_every_public_name_loads_from_its_module():
    for name in collectors.__all__:
        assert getattr(collectors, name).__module__.startswith("collectors."), name
    assert set(collectors.__all__) <= set(dir(collectors))
    with pytest.raises(AttributeError, match="no attribute 'Monitr'"):
        collectors.Monitr  # noqa: B018 - a typo must fail as loudly as with eager imports


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
    # the read side (dashboard, watcher, reports) imports the keys: no torch for them
    assert _loaded_after("import collectors, collectors.keys") == []
    # the training side: torch, the one heavy import the collectors are allowed; mlflow when a run opens
    assert _loaded_after("from collectors import Monitor, policy_metrics, check_gradients") == ["torch"]
