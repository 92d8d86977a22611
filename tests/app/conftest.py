"""Stores for the read side's tests: one migrated SQLite file per session, copied per test. Runs are
written with `tests.helpers.runs` (open_run + MetricWriter, as rldiag writes them)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def template_db(tmp_path_factory) -> Path:
    """One migrated MLflow SQLite file, copied per test (migrations cost seconds each)."""
    from mlflow import MlflowClient

    path = tmp_path_factory.mktemp("mlflow-template") / "mlruns.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def store_uri(sqlite_uri: str, template_db: Path) -> str:
    """A fresh, migrated SQLite store (sqlite:///...) in the test's tmp_path."""
    shutil.copyfile(template_db, sqlite_uri.removeprefix("sqlite:///"))
    return sqlite_uri
