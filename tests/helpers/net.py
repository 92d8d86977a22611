"""Local servers for the tests: a free port, a real `mlflow server`, the dashboard (`rldiag app`) in its
own process group. The benchmarks use them too, so they stay in `bench/_server.py`; the tests import
them from here only."""

from __future__ import annotations

from bench._server import MlflowServer, free_port, start_dashboard, stop_group

__all__ = ["MlflowServer", "free_port", "start_dashboard", "stop_group"]
