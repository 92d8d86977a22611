"""Shared fixtures: a SQLite tracking store in a temp dir, and a real `mlflow server` on 127.0.0.1
(`tests.helpers.net.MlflowServer`, which the benchmarks use too)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from tests.helpers.net import MlflowServer

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
# The read side's disk cache (rldiag.app.data.disk_cache): one per test session, never the user's own.
CACHE_DIR = tempfile.mkdtemp(prefix="rldiag-test-cache-")
os.environ["RLDIAG_CACHE_DIR"] = CACHE_DIR


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


@pytest.fixture(autouse=True)
def _restore_main_module():
    """Streamlit's script runner (AppTest, in the dashboard, read-only and likely-cause tests) installs
    the page script as `sys.modules["__main__"]`; a later `spawn` start method (vLLM's engine core,
    torch.multiprocessing in the distributed tests) would re-run that script in its children and die.
    Put pytest's own `__main__` back after every test."""
    main = sys.modules.get("__main__")
    yield
    if main is not None:
        sys.modules["__main__"] = main


# Test files that share one session fixture: under xdist (make test: `-n 2`) they run in one worker, so it is
# built once (the engine-parity store starts six vLLM engines). Every other file is its own unit of work, so
# its module-scoped fixtures (a real `mlflow server`, a trained tiny model) are built once, as in a serial run.
SHARED_FIXTURE_FILES = {
    "parity_store": ("tests/experiments/test_engine_parity.py", "tests/experiments/test_causes_engine_parity.py",
                     "tests/experiments/test_divergence_onsets.py",
                     "tests/experiments/test_is_health_engine_parity.py"),
}


@pytest.hookimpl(optionalhook=True)  # xdist's hook: without pytest-xdist the suite runs serially
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """xdist's scheduler, by file and by shared fixture (`--dist loadgroup` would do it with markers, but
    xdist 3.8 tags the node ids through an attribute pytest 9 no longer reads, so every test went alone)."""
    from xdist.scheduler import LoadScopeScheduling

    unit = {path: f"shared:{name}" for name, paths in SHARED_FIXTURE_FILES.items() for path in paths}

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return unit.get(path, path)

    return ByFile(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that uses a shared session fixture from a file SHARED_FIXTURE_FILES does not list would build
    it a second time in another worker: say so instead."""
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        for name, paths in SHARED_FIXTURE_FILES.items():
            if name in getattr(item, "fixturenames", ()) and path not in paths:
                raise pytest.UsageError(f"{item.nodeid} uses the session fixture {name!r}: add {path!r} to "
                                        "SHARED_FIXTURE_FILES in tests/conftest.py")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The whole run loaded each module once: as `rldiag.<part>.x`, never also under a bare folder name
    (`collectors.x`, `app.x`, `experiments.x`, importable because the repository root is on sys.path)."""
    import sys

    shutil.rmtree(CACHE_DIR, ignore_errors=True)
    bare = sorted(m for m in sys.modules if m.split(".")[0] in ("app", "collectors", "experiments"))
    if bare:
        print(f"\nmodules loaded under a bare folder name (import rldiag.<name> instead): {bare}", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
