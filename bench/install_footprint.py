"""What `pip install rldiag` puts in a venv, against `rldiag[app]`: size, distributions, import time.

    python -m bench.install_footprint                         # core and [app]: ~6 min with pip's cache warm
    python -m bench.install_footprint --variants core,app,skinny --out /tmp/footprint.json

For each variant: a fresh venv, `pip install torch==2.13.0` (the local CPU wheel: its site-packages
is the baseline a training venv already has), then the wheel built from this tree. Reported: the
site-packages size (apparent file sizes, MB = 10^6 bytes) in all, without the `torch` distribution,
and what the install added over the torch-only baseline; the number of distributions; whether the
dashboard stack (streamlit, plotly) came along; the wall time of `python -c "import rldiag"` and
`python -c "from rldiag import Monitor"` (median of `--runs` fresh interpreters after one warm-up,
with `python -c pass`, `import torch` and `import torch, mlflow` alongside: Monitor's import is
torch's, and the first `Monitor(...)` imports mlflow); and a 5-step `Monitor` loop into a SQLite
store as a smoke test. `skinny` (not a supported install, for comparison only): `mlflow-skinny` of
the same version as this interpreter's mlflow, with sqlalchemy and alembic for the SQLite store,
numpy and tqdm, and the wheel with `--no-deps`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from importlib.metadata import version
from pathlib import Path

import bench  # noqa: F401 - sets MLFLOW_DISABLE_TELEMETRY
from bench._common import env_info, summary_row, write_result

NAME = "install_footprint"
REPO = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"  # the local CPU wheel; an unpinned torch would pull a multi-GB CUDA build
VARIANTS = ("core", "app", "skinny")
LEAKY = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "MLFLOW_TRACKING_URI", "PYTHONSTARTUP")
MB = 1e6

# Run in the venv's interpreter: sizes per distribution (from its RECORD) and what is importable.
_INVENTORY = """
import importlib.util, json, os, sys, sysconfig
from importlib.metadata import distributions
site = sysconfig.get_paths()["purelib"]
sizes = {}
for d in distributions():
    n = 0
    for f in d.files or ():
        p = d.locate_file(f)
        try:
            n += os.stat(p).st_size
        except OSError:
            pass
    sizes[d.metadata["Name"]] = n
total = sum(os.stat(os.path.join(r, f)).st_size for r, _, fs in os.walk(site) for f in fs
            if not os.path.islink(os.path.join(r, f)))
print(json.dumps({"site_packages_bytes": total, "dists": sizes,
                  "present": {m: importlib.util.find_spec(m) is not None
                              for m in ("streamlit", "plotly", "pandas", "pyarrow", "sklearn", "scipy", "matplotlib",
                                        "sqlalchemy", "alembic", "flask")}}))
"""

_LOOP = """
import sys, torch, mlflow
from rldiag import Monitor
from rldiag.collectors import keys
uri = sys.argv[1]
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
with Monitor("footprint", run_name="five-steps", tracking_uri=uri, policy="warn") as mon:
    for step in range(5):
        model(torch.randn(8, 4)).pow(2).mean().backward()
        mon.step(step, model)
        model.zero_grad()
steps = sorted(m.step for m in mlflow.MlflowClient(uri).get_metric_history(mon.run_id, keys.GRAD_NORM))
assert steps == [0, 1, 2, 3, 4], steps
"""

_MODULES = "import sys; {stmt}; print(len(sys.modules), 'mlflow' in sys.modules, 'torch' in sys.modules)"


def _env(venv: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LEAKY}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["MLFLOW_DISABLE_TELEMETRY"] = "true"
    return env


def _py(venv: Path, *args: str, cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([str(venv / "bin" / "python"), *args], check=False, cwd=cwd, env=_env(venv),
                          capture_output=True, text=True, timeout=timeout)


def _pip(venv: Path, *args: str, cwd: Path) -> float:
    t0 = time.perf_counter()
    res = _py(venv, "-m", "pip", "install", "-q", "--no-input", *args, cwd=cwd)
    if res.returncode:
        raise SystemExit(f"pip install {' '.join(args)} failed:\n{res.stderr[-3000:]}")
    return time.perf_counter() - t0


def build_wheel(work: Path) -> Path:
    """The wheel of a copy of what the build reads (a stale build/ in the tree cannot leak into it)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    src = work / "src"
    src.mkdir()
    for name in ("pyproject.toml", project["project"]["readme"]):
        shutil.copy(REPO / name, src / name)
    for folder in set(project["tool"]["setuptools"]["package-dir"].values()):
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(work / "dist"), str(src)], check=True, timeout=300)
    [whl] = (work / "dist").glob("rldiag-*.whl")
    return whl


def inventory(venv: Path, cwd: Path) -> dict:
    res = _py(venv, "-c", _INVENTORY, cwd=cwd, timeout=120)
    if res.returncode:
        raise SystemExit(f"inventory failed:\n{res.stderr}")
    return json.loads(res.stdout)


def wall_ms(venv: Path, code: str, cwd: Path, runs: int) -> dict:
    """Median (and min/max) wall time of `python -c code` in fresh interpreters, after one warm-up."""
    samples = []
    for i in range(runs + 1):
        t0 = time.perf_counter()
        res = _py(venv, "-c", code, cwd=cwd, timeout=120)
        dt = time.perf_counter() - t0
        if res.returncode:
            raise SystemExit(f"python -c {code!r} failed:\n{res.stderr}")
        if i:
            samples.append(dt * 1e3)
    return {"median_ms": statistics.median(samples), "min_ms": min(samples), "max_ms": max(samples), "n": runs}


def measure(variant: str, wheel: Path, work: Path, runs: int) -> dict:
    root = work / variant
    root.mkdir()
    venv = root / "venv"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    times = {"venv_s": time.perf_counter() - t0, "torch_s": _pip(venv, TORCH, cwd=root)}
    base = inventory(venv, root)
    if variant == "core":
        times["rldiag_s"] = _pip(venv, str(wheel), cwd=root)
    elif variant == "app":
        times["rldiag_s"] = _pip(venv, f"{wheel}[app]", cwd=root)
    else:  # skinny: the same mlflow release without its server/UI/ML stack, and the SQL store's two packages
        times["rldiag_s"] = _pip(venv, f"mlflow-skinny=={version('mlflow')}", "sqlalchemy", "alembic", "numpy",
                                 "tqdm", cwd=root)
        times["rldiag_s"] += _pip(venv, "--no-deps", str(wheel), cwd=root)
    times["total_s"] = time.perf_counter() - t0
    inv = inventory(venv, root)
    added = {k: v for k, v in inv["dists"].items() if k not in base["dists"]}
    torch_bytes = inv["dists"].get("torch", 0)
    loop = _py(venv, "-c", _LOOP, f"sqlite:///{root / 'mlruns.db'}", cwd=root, timeout=300)
    mods = {}
    for stmt in ("import rldiag", "from rldiag import Monitor", "import torch", "import torch, mlflow"):
        n, mlflow_loaded, torch_loaded = _py(venv, "-c", _MODULES.format(stmt=stmt), cwd=root).stdout.split()
        mods[stmt] = {"modules": int(n), "mlflow_loaded": mlflow_loaded == "True",
                      "torch_loaded": torch_loaded == "True"}
    return {
        "variant": variant,
        "install_s": times,
        "site_packages_mb": inv["site_packages_bytes"] / MB,
        "site_packages_without_torch_mb": (inv["site_packages_bytes"] - torch_bytes) / MB,
        "torch_baseline_mb": base["site_packages_bytes"] / MB,
        "added_over_torch_mb": (inv["site_packages_bytes"] - base["site_packages_bytes"]) / MB,
        "distributions": len(inv["dists"]),
        "distributions_added_over_torch": len(added),
        "largest_added_mb": {k: v / MB for k, v in sorted(added.items(), key=lambda kv: -kv[1])[:12]},
        "present": inv["present"],
        "import_wall": {
            "python -c pass": wall_ms(venv, "pass", root, runs),
            "import rldiag": wall_ms(venv, "import rldiag", root, runs),
            "from rldiag import Monitor": wall_ms(venv, "from rldiag import Monitor", root, runs),
            # what Monitor's import costs is torch's; its first Monitor(...) then imports mlflow
            "import torch": wall_ms(venv, "import torch", root, runs),
            "import torch, mlflow": wall_ms(venv, "import torch, mlflow", root, runs),
        },
        "modules_after": mods,
        "monitor_loop_sqlite": "ok" if loop.returncode == 0 else (loop.stderr.strip().splitlines() or ["?"])[-1][:400],
    }


def table(results: list[dict]) -> str:
    cols = ["variant", "site-packages MB", "without torch MB", "added over torch MB", "dists (added)",
            "streamlit / plotly", "`import rldiag` ms", "`from rldiag import Monitor` ms", "`import torch` ms",
            "`import torch, mlflow` ms", "`python -c pass` ms",
            "install s", "5-step loop"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in results:
        w, p = r["import_wall"], r["present"]
        lines.append("| " + " | ".join([
            r["variant"], f"{r['site_packages_mb']:.0f}", f"{r['site_packages_without_torch_mb']:.0f}",
            f"{r['added_over_torch_mb']:.0f}", f"{r['distributions']} ({r['distributions_added_over_torch']})",
            f"{'yes' if p['streamlit'] else 'no'} / {'yes' if p['plotly'] else 'no'}",
            f"{w['import rldiag']['median_ms']:.0f}", f"{w['from rldiag import Monitor']['median_ms']:.0f}",
            f"{w['import torch']['median_ms']:.0f}", f"{w['import torch, mlflow']['median_ms']:.0f}",
            f"{w['python -c pass']['median_ms']:.0f}", f"{r['install_s']['total_s']:.0f}",
            r["monitor_loop_sqlite"] if r["monitor_loop_sqlite"] == "ok" else "**failed**",
        ]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="core,app",
                    help=f"comma-separated, of {', '.join(VARIANTS)} (default: core,app)")
    ap.add_argument("--runs", type=int, default=5, help="fresh interpreters per import timing (default: 5)")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default: bench/results/install_footprint.json)")
    ap.add_argument("--keep", action="store_true", help="keep the venvs (their folder is printed)")
    ap.add_argument("--quick", action="store_true", help="3 fresh interpreters per import timing (bench.run_all --quick)")
    args = ap.parse_args(argv)
    if args.quick:
        args.runs = min(args.runs, 3)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if bad := [v for v in variants if v not in VARIANTS]:
        ap.error(f"unknown variant(s) {bad}: use {', '.join(VARIANTS)}")

    work = Path(tempfile.mkdtemp(prefix="rldiag-footprint-"))
    try:
        t0 = time.perf_counter()
        wheel = build_wheel(work)
        wheel_s, wheel_mb = time.perf_counter() - t0, wheel.stat().st_size / MB
        print(f"wheel {wheel.name} ({wheel_mb:.2f} MB) built in {wheel_s:.1f} s", flush=True)
        results = []
        for v in variants:
            print(f"[{v}] fresh venv, {TORCH}, then the wheel ...", flush=True)
            results.append(measure(v, wheel, work, args.runs))
            r = results[-1]
            print(f"[{v}] installed in {r['install_s']['total_s']:.0f} s; largest added: "
                  + ", ".join(f"{k} {mb:.0f}" for k, mb in list(r["largest_added_mb"].items())[:6]), flush=True)
    finally:
        if args.keep:
            print(f"venvs kept under {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    md = table(results)
    print("\n" + md)
    out = {"benchmark": NAME, "env": env_info(), "torch": TORCH, "wheel": wheel.name,
           "wheel_mb": wheel_mb, "wheel_build_s": wheel_s,
           "runs": args.runs, "results": results, "table": md}
    by = {r["variant"]: r for r in results}
    if "core" in by:
        c = by["core"]
        out["summary"] = [summary_row(
            "training install (`pip install rldiag`): added over a torch venv / `from rldiag import Monitor`",
            f"{c['added_over_torch_mb']:.0f} MB, {c['distributions_added_over_torch']} dists; "
            f"{c['import_wall']['from rldiag import Monitor']['median_ms']:.0f} ms",
            (f"rldiag[app]: {by['app']['added_over_torch_mb']:.0f} MB, "
             f"{by['app']['distributions_added_over_torch']} dists") if "app" in by else "-",
            "-", "no streamlit/plotly", not (c["present"]["streamlit"] or c["present"]["plotly"]))]
    path = write_result(NAME, out) if args.out is None else args.out
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(f"\nwrote {path}")
    return out


if __name__ == "__main__":
    main()
