"""Shared fixtures: a SQLite tracking store in a temp dir, and a real `mlflow server` on 127.0.0.1
(`bench._server.MlflowServer`, which the benchmarks use too)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench._server import MlflowServer, free_port  # noqa: F401 - re-exported for the tests

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


@pytest.fixture
def sqlite_uri(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh SQLite store; the test runs in tmp_path so journals and artifacts land there too."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return f"sqlite:///{tmp_path / 'mlruns.db'}"


@pytest.fixture
def mlflow_server(tmp_path: Path):
    server = MlflowServer(tmp_path)
    server.start()
    yield server
    server.kill()
