"""A test that installs like a user: build the wheel, `pip install` it into a fresh venv, and check what a
user would check before trusting it in a research repo.

- The wheel holds one top-level package, `rldiag`, with its package data (py.typed, the vendored
  plotly.js bundle), every source file of the tree under its installed name, and the `rldiag` console
  script; never bare `app/`, `collectors/` or `experiments/` packages that would shadow the user's.
- `pip install rldiag` (the training side: torch, mlflow-skinny and the SQLite store) gives a CLI whose
  every command prints its help, or, for a read-side command, one line naming `pip install 'rldiag[app]'`
  (never a traceback).
- A `Monitor` loop logs to a SQLite store that a second interpreter reads back with MLflow's client.
- The training install brings no dashboard stack (streamlit, plotly, full mlflow's server), and leaves
  the user's own `app`, `collectors`, `experiments` packages alone.
- `pip install 'rldiag[app]'` adds the read side: the dashboard and report commands then work.

Every command runs with a user's folder as its cwd and on PYTHONPATH; that folder has its own `app/`,
`collectors/`, `experiments/` packages whose `keys.py` and `cli.py` raise when imported, so a bare import
of one of those names by rldiag fails loudly.
"""

from __future__ import annotations

import configparser
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
import zipfile
from pathlib import Path, PurePosixPath

import pytest

REPO = Path(__file__).resolve().parents[2]
TORCH = "torch==2.13.0"  # the local CPU wheel: an unpinned torch would pull a multi-GB CUDA build
# repository folder -> installed package (pyproject's [tool.setuptools] package-dir)
FOLDERS = {"rldiag": "rldiag", "collectors": "rldiag/collectors", "app": "rldiag/app",
           "experiments": "rldiag/experiments"}
USER_PACKAGES = ("app", "collectors", "experiments")
COMMANDS = ("demo", "sync", "experiment", "watch", "report", "app", "preflight", "import")
EXTRA_HINT = "pip install 'rldiag[app]'"
# what the test's own environment must not hand to the venv's interpreters
LEAKY = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONSAFEPATH", "PYTHONNOUSERSITE", "VIRTUAL_ENV",
         "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID")


def _tree_python_files() -> set[str]:
    """The tree's `.py` files of the package, by the path they get in the wheel."""
    out = set()
    for folder, installed in FOLDERS.items():
        for p in (REPO / folder).rglob("*.py"):
            if "__pycache__" not in p.parts:
                out.add(str(PurePosixPath(installed, *p.relative_to(REPO / folder).parts)))
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from a copy of what the build reads: a stale build/ cannot leak in, the tree stays as it is."""
    work = tmp_path_factory.mktemp("wheel")
    src, dist = work / "src", work / "dist"
    src.mkdir()
    readme = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["readme"]
    for name in ("pyproject.toml", readme):
        shutil.copy(REPO / name, src / name)
    for folder in FOLDERS:
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(dist), str(src)], capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0, f"pip wheel failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    [whl] = dist.glob("rldiag-*.whl")
    print(f"\nbuilt {whl.name} ({whl.stat().st_size / 1e6:.2f} MB) in {time.perf_counter() - t0:.1f} s")
    return whl


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user's research repo with its own `app`, `collectors`, `experiments` packages."""
    root = tmp_path_factory.mktemp("user_repo")
    for name in USER_PACKAGES:
        pkg = root / name
        pkg.mkdir()
        (pkg / "__init__.py").write_text(f'"""The user\'s own `{name}` package."""\nUSER_PACKAGE = {name!r}\n')
        for mod in ("keys", "cli"):
            (pkg / f"{mod}.py").write_text(
                f'raise RuntimeError("the user\'s {name}.{mod} was imported: rldiag must import rldiag.{name}")\n')
    return root


def _env(venv: Path, user_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LEAKY}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(user_dir)
    env["MLFLOW_DISABLE_TELEMETRY"] = "true"
    return env


class Venv:
    def __init__(self, path: Path, user_dir: Path):
        self.path, self.user_dir = path, user_dir
        self.python = path / "bin" / "python"

    def run(self, *args: str | Path, timeout: float = 600) -> subprocess.CompletedProcess:
        """A command of the venv (`python`, `rldiag`, ...) in the user's folder, with it on PYTHONPATH."""
        cmd = [str(self.path / "bin" / str(args[0])), *map(str, args[1:])]
        return subprocess.run(cmd, cwd=self.user_dir, env=_env(self.path, self.user_dir), capture_output=True,
                              text=True, timeout=timeout, check=False)

    def py(self, code: str, *args: str | Path, timeout: float = 600) -> subprocess.CompletedProcess:
        return self.run("python", "-c", code, *args, timeout=timeout)

    def pip_install(self, *args: str | Path) -> float:
        t0 = time.perf_counter()
        res = self.run("python", "-m", "pip", "install", "-q", "--no-input", *args, timeout=1100)
        assert res.returncode == 0, f"pip install {' '.join(map(str, args))} failed:\n{res.stderr[-4000:]}"
        return time.perf_counter() - t0


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory, wheel: Path, user_dir: Path):
    """A fresh venv with torch (the local CPU wheel) and the wheel's core install; removed after the module."""
    path = tmp_path_factory.mktemp("venv") / "venv"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=300)
    v = Venv(path, user_dir)
    try:
        t_venv = time.perf_counter() - t0
        t_torch = v.pip_install(TORCH)
        t_rldiag = v.pip_install(wheel)
        print(f"\nvenv {t_venv:.0f} s, {TORCH} {t_torch:.0f} s, pip install {wheel.name} {t_rldiag:.0f} s "
              f"(total {time.perf_counter() - t0:.0f} s)")
        yield v
    finally:
        shutil.rmtree(path, ignore_errors=True)  # over 1 GB


def _one_line_naming_the_extra(res: subprocess.CompletedProcess) -> bool:
    lines = res.stderr.strip().splitlines()
    return res.returncode == 2 and len(lines) == 1 and lines[0].rstrip().endswith(EXTRA_HINT)


def test_wheel_holds_only_the_rldiag_namespace_with_its_package_data(wheel: Path):
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if not n.endswith("/")]
        [dist_info] = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
        entry_points = zf.read(f"{dist_info}/entry_points.txt").decode()
    top = {n.split("/")[0] for n in names}
    assert top == {"rldiag", dist_info}, f"top level of the wheel: {sorted(top)}"
    assert not top & set(USER_PACKAGES), "bare top-level packages would shadow a research repo's own"
    assert dist_info.startswith("rldiag-")
    for data in ("rldiag/py.typed", "rldiag/app/dashboard/static/plotly-basic.min.js"):
        assert data in names, f"{data} is missing from the wheel"

    in_wheel = {n for n in names if n.endswith(".py")}
    in_tree = _tree_python_files()
    assert in_wheel == in_tree, (f"in the tree, not in the wheel: {sorted(in_tree - in_wheel)}; "
                                 f"in the wheel, not in the tree: {sorted(in_wheel - in_tree)}")

    eps = configparser.ConfigParser()
    eps.read_string(entry_points)
    assert dict(eps["console_scripts"]) == {"rldiag": "rldiag.app.cli.main:main"}


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_every_command_helps_or_names_the_app_extra(venv: Venv):
    res = venv.run("rldiag", "--help")
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stdout + res.stderr
    for name in COMMANDS:
        assert name in res.stdout, f"`rldiag --help` does not list {name}:\n{res.stdout}"

    outcomes = {}
    for name in COMMANDS:
        res = venv.run("rldiag", name, "--help", timeout=300)
        out = f"rldiag {name} --help -> {res.returncode}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr}"
        assert "Traceback" not in res.stdout + res.stderr, out
        if name in ("demo", "sync", "experiment"):  # the training side: always there
            assert res.returncode == 0 and "usage: rldiag " + name in res.stdout and res.stderr == "", out
        else:  # the read side: help, or one line naming the extra
            helped = res.returncode == 0 and "usage: rldiag " + name in res.stdout
            assert helped or _one_line_naming_the_extra(res), out
        outcomes[name] = res
    # without [app] installed, the dashboard names the extra; the report's help needs no library (its text and
    # defaults are in a light module), and running it names the extra, in one line
    assert _one_line_naming_the_extra(outcomes["app"]), outcomes["app"].stderr
    assert outcomes["app"].stdout == ""
    assert outcomes["report"].returncode == 0 and "usage: rldiag report" in outcomes["report"].stdout
    res = venv.run("rldiag", "report", "--group", "g", timeout=300)
    assert _one_line_naming_the_extra(res) and res.stdout == "", res.stderr
    # preflight's help needs no extra; running it without vLLM and transformers names theirs, in one line
    assert outcomes["preflight"].returncode == 0, outcomes["preflight"].stderr
    res = venv.run("rldiag", "preflight", "--model", ".", timeout=300)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "pip install 'rldiag[vllm,hf]'" in lines[0], res.stderr
    print("\n" + "\n".join(f"rldiag {n} --help: exit {r.returncode}" + (f": {r.stderr.strip()}" if r.returncode else "")
                           for n, r in outcomes.items()))


_LOOP = """
import json, sys
import torch
from rldiag import Monitor

uri = sys.argv[1]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with Monitor("wheel-test", run_name="five-steps", tracking_uri=uri, policy="raise") as mon:
    for step in range(5):
        loss = (model(torch.randn(16, 4)) - 1.0).pow(2).mean()
        loss.backward()
        mon.step(step, model, loss=loss)
        opt.step()
        opt.zero_grad()
bare = sorted(m for m in sys.modules if m.split(".")[0] in ("app", "collectors", "experiments"))
assert not bare, f"bare top-level modules loaded: {bare}"
print(json.dumps({"run_id": mon.run_id}))
"""

_READ = """
import json, sys
import mlflow
from rldiag.collectors.keys import GRAD_NORM

uri, run_id = sys.argv[1:3]
history = mlflow.MlflowClient(tracking_uri=uri).get_metric_history(run_id, GRAD_NORM)
print(json.dumps({"key": GRAD_NORM, "points": sorted((m.step, m.value) for m in history)}))
"""


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_monitor_logs_five_steps_to_sqlite(venv: Venv, tmp_path: Path):
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    res = venv.py(_LOOP, uri)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "Traceback" not in res.stderr, res.stderr[-4000:]
    run_id = json.loads(res.stdout.strip().splitlines()[-1])["run_id"]

    res = venv.py(_READ, uri, run_id)
    assert res.returncode == 0, res.stderr[-4000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["key"] == "grad/norm"
    points = got["points"]
    assert [s for s, _ in points] == [0, 1, 2, 3, 4], points
    assert all(v > 0 for _, v in points), points


_INSTALLED = """
import importlib, importlib.metadata as md, importlib.util, json, sys
out = {}
for mod in ("streamlit", "plotly", "flask"):
    try:
        importlib.import_module(mod)
        out[mod] = "imported"
    except ModuleNotFoundError as e:
        out[mod] = f"missing:{e.name}"
for dist in ("mlflow", "mlflow-skinny", "streamlit", "plotly"):
    try:
        out["dist:" + dist] = md.version(dist)
    except md.PackageNotFoundError:
        out["dist:" + dist] = None
import torch, rldiag
out["torch"] = torch.__version__
out["rldiag"] = rldiag.__file__
out["prefix"] = sys.prefix
for name in ("app", "collectors", "experiments"):
    pkg = importlib.import_module(name)
    out[name] = {"file": pkg.__file__, "marker": getattr(pkg, "USER_PACKAGE", None)}
    for mod in ("keys", "cli"):
        try:
            importlib.import_module(f"{name}.{mod}")
            out[f"{name}.{mod}"] = "imported"
        except RuntimeError as e:
            out[f"{name}.{mod}"] = f"RuntimeError: {e}"
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_training_install_has_no_dashboard_stack_and_leaves_the_users_packages_alone(venv: Venv):
    res = venv.py(_INSTALLED)
    assert res.returncode == 0, res.stderr[-4000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    print("\n" + json.dumps(got, indent=1))
    # the dashboard stack is the [app] extra's
    assert got["streamlit"] == "missing:streamlit"
    assert got["plotly"] == "missing:plotly"
    assert got["dist:streamlit"] is None and got["dist:plotly"] is None
    # the training side logs through mlflow-skinny: full mlflow (its server: flask, gunicorn) is not there
    assert got["dist:mlflow"] is None, f"full mlflow {got['dist:mlflow']} came with the core install"
    assert got["dist:mlflow-skinny"] and got["dist:mlflow-skinny"].startswith("3.17.")
    assert got["flask"] == "missing:flask"
    assert got["torch"] == "2.13.0+cpu"
    # rldiag is the venv's, not the tree's
    assert Path(got["rldiag"]).resolve().is_relative_to(venv.path.resolve()), got["rldiag"]
    assert Path(got["prefix"]).resolve() == venv.path.resolve()
    # the user's own packages are theirs
    for name in USER_PACKAGES:
        assert Path(got[name]["file"]).resolve() == (venv.user_dir / name / "__init__.py").resolve(), got[name]
        assert got[name]["marker"] == name
        for mod in ("keys", "cli"):
            assert got[f"{name}.{mod}"] == (f"RuntimeError: the user's {name}.{mod} was imported: rldiag must "
                                            f"import rldiag.{name}"), got[f"{name}.{mod}"]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_app_extra_adds_the_read_side(venv: Venv, wheel: Path):
    """Last in the module: it installs [app] into the module's venv."""
    took = venv.pip_install(f"{wheel}[app]")
    print(f"\npip install '{wheel.name}[app]' {took:.0f} s")
    for name in ("report", "app"):
        res = venv.run("rldiag", name, "--help", timeout=300)
        out = f"rldiag {name} --help -> {res.returncode}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr}"
        assert res.returncode == 0 and f"usage: rldiag {name}" in res.stdout, out
        assert "Traceback" not in res.stderr and EXTRA_HINT not in res.stderr, out
    res = venv.py("import streamlit, plotly, rldiag.app.dashboard.chart_grid as g; print(g.__file__)")
    assert res.returncode == 0, res.stderr[-4000:]
    assert Path(res.stdout.strip().splitlines()[-1]).resolve().is_relative_to(venv.path.resolve())
