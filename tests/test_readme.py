"""README's Python examples cannot rot: every import they show resolves, every keyword they pass to
rldiag is one its function takes, and the read-side example runs for real on a store that
`rldiag demo` wrote (as a reader following README would do)."""

from __future__ import annotations

import ast
import contextlib
import inspect
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(encoding="utf-8"), re.S)


def imported(tree: ast.Module) -> dict[str, object]:
    """name -> the object each `from rldiag... import name` of the block gives."""
    import importlib

    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rldiag"):
            mod = importlib.import_module(node.module)
            for a in node.names:
                out[a.asname or a.name] = getattr(mod, a.name)  # AttributeError: README names a missing API
        elif isinstance(node, ast.Import):
            for a in node.names:
                importlib.import_module(a.name)
    return out


def accepted(obj) -> set[str] | None:
    """Keyword names `obj` takes (None: any). Monitor and RldiagCallback forward RunSession's options."""
    from rldiag.collectors.session import RunSession

    params = inspect.signature(obj).parameters
    names = {n for n, p in params.items() if p.kind is not p.VAR_KEYWORD}
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        if getattr(obj, "__name__", "") in ("Monitor", "RldiagCallback"):
            return names | set(inspect.signature(RunSession).parameters)
        return None
    return names


def test_readme_has_python_examples():
    assert len(BLOCKS) >= 4  # the loop, the Trainer callback, vLLM, the read side


@pytest.mark.parametrize("n", range(len(BLOCKS)))
def test_every_import_resolves_and_every_keyword_exists(n):
    tree = ast.parse(BLOCKS[n])
    names = imported(tree)
    # `with Monitor(...) as mon:` makes mon a Monitor: check its method calls too
    instances = {item.optional_vars.id: names[item.context_expr.func.id]
                 for node in ast.walk(tree) if isinstance(node, ast.With) for item in node.items
                 if isinstance(item.context_expr, ast.Call) and isinstance(item.context_expr.func, ast.Name)
                 and item.context_expr.func.id in names and isinstance(item.optional_vars, ast.Name)}
    checked = 0
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id in names:
            target = names[f.id]
        elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in instances:
            target = getattr(instances[f.value.id], f.attr)  # AttributeError: README calls a missing method
        elif (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Call) and isinstance(f.value.func, ast.Name)
              and f.value.func.id in names):
            target = getattr(names[f.value.func.id], f.attr)  # RldiagCallback(...).attach(trainer)
        else:
            continue
        ok = accepted(target)
        kws = {k.arg for k in node.keywords if k.arg}
        assert ok is None or kws <= ok, f"README calls {ast.unparse(f)} with {sorted(kws - ok)}, which it does not take"
        checked += 1
    assert checked, "no call of an rldiag API checked in this block"


@pytest.mark.slow
def test_the_read_side_example_runs_on_a_demo_store(tmp_path):
    [block] = [b for b in BLOCKS if "from rldiag.app import" in b]
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    env.pop("MLFLOW_TRACKING_URI", None)
    for nan_at in (None, 6):  # two runs: a clean one (the reference) and one with a NaN gradient
        cmd = [sys.executable, "-m", "rldiag.app.cli.main", "demo", "--steps", "12"]
        if nan_at is not None:
            cmd += ["--nan-at", str(nan_at)]
        subprocess.run(cmd, cwd=tmp_path, env=env, check=True, capture_output=True, timeout=300)
    out = io.StringIO()
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(block, "README.md", "exec"), {})
    finally:
        os.chdir(cwd)
    assert "non-finite gradients at step 6" in out.getvalue()
    assert "<html" in (tmp_path / "rldiag-report.html").read_text().lower()
