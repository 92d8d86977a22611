"""The package's public surface: a pinned `__all__`, and an import that stays light."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

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


def test_all_matches_what_the_package_imports():
    imported = {
        name
        for name, value in vars(collectors).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert imported == set(collectors.__all__)
    for name in collectors.__all__:
        assert getattr(collectors, name).__module__.startswith("collectors."), name


def test_import_collectors_loads_no_heavy_dependency():
    code = (
        "import json, sys\n"
        "import collectors\n"
        "heavy = ('mlflow', 'transformers', 'vllm', 'streamlit')\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in heavy)\n"
        "print(json.dumps({'loaded': loaded, 'torch': 'torch' in sys.modules}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["loaded"] == []
    assert result["torch"]  # the one heavy import the collectors are allowed
