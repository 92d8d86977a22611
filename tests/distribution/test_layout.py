"""The repository's layout as users and contributors rely on it.

- One namespace: every file imports `rldiag.collectors`, `rldiag.app`, `rldiag.experiments`, never the
  bare folder names (a research repo has its own `app/`, `collectors/`, `experiments/`).
- pyproject's package list names every package folder, so the wheel carries all of them.
- `app/` is layered (DESIGN.md, "Three parts, one direction"): each layer imports only the layers
  below it, and no import cycle runs through the read side. `collectors/` and `experiments/` import
  nothing of `app/`.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
OLD = ("app", "collectors", "experiments")
FOLDERS = {"rldiag.collectors": "collectors", "rldiag.app": "app", "rldiag.experiments": "experiments",
           "rldiag": "rldiag"}
SOURCES = ("rldiag", "collectors", "app", "experiments", "tests", "bench")

# `app/`'s layers, lowest first. A module may import its own layer and the ones below it. The
# dashboard sits above the report: its "Build report" button offers the report for download.
LAYERS = ["errors", "data", "analysis", "plots", "report", "watch", "preflight", "importers", "dashboard", "cli"]
RANK = {"errors": 0, "data": 1, "analysis": 2, "plots": 3, "report": 4, "watch": 4, "preflight": 4, "importers": 4,
        "dashboard": 5, "cli": 6}


def python_files() -> list[Path]:
    return sorted(p for d in SOURCES for p in (REPO / d).rglob("*.py") if "__pycache__" not in p.parts)


def module_name(path: Path) -> str | None:
    """The installed name of a file of the package (None for tests and bench)."""
    rel = path.relative_to(REPO)
    for pkg, folder in FOLDERS.items():
        if rel.parts[0] == folder:
            parts = [*pkg.split("."), *rel.with_suffix("").parts[1:]]
            return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    return None


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, function-local ones included, relative ones resolved."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    me = module_name(path) or ""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = me.split(".")[: len(me.split(".")) - node.level + (path.name == "__init__.py")]
                base = ".".join([*pkg, base] if base else pkg)
            out.append((node.lineno, base))
            # `from rldiag.app.data import readers`: the submodule is imported too
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return out


def test_no_file_imports_the_old_top_level_names():
    bad = [f"{p.relative_to(REPO)}:{line}: {mod}" for p in python_files() for line, mod in imports(p)
           if mod.split(".")[0] in OLD]
    # module names in strings too (importlib.import_module, `python -m`, mock targets)
    for p in python_files():
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and node.value.split(".")[0] in OLD and "." in node.value and " " not in node.value
                    and "/" not in node.value and not node.value.endswith((".py", ".log", ".db", ".json"))):
                bad.append(f"{p.relative_to(REPO)}:{node.lineno}: {node.value!r}")
    assert not bad, "import rldiag.<name>, not the bare folder name:\n" + "\n".join(bad)


def test_no_module_is_loaded_under_its_folder_name():
    """Running pytest from the repository root puts the root on sys.path, so `import collectors` would
    work and load a second copy of each module beside `rldiag.collectors`: nothing may do that."""
    assert not [m for m in sys.modules if m.split(".")[0] in OLD]


def test_pyproject_lists_every_package_folder():
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert cfg["package-dir"] == {k: v for k, v in FOLDERS.items()}
    folders = {module_name(p.parent / "__init__.py") for p in python_files() if p.name == "__init__.py"
               and module_name(p) is not None}
    assert folders == set(cfg["packages"]), (
        f"pyproject's [tool.setuptools] packages misses {sorted(folders - set(cfg['packages']))} "
        f"or lists {sorted(set(cfg['packages']) - folders)} that has no folder")
    for folder in FOLDERS.values():  # a package folder without __init__.py would ship nothing
        for d in (REPO / folder).rglob("*"):
            if d.is_dir() and any(d.glob("*.py")) and "__pycache__" not in d.parts:
                assert (d / "__init__.py").exists(), f"{d.relative_to(REPO)} has modules but no __init__.py"


def app_graph() -> dict[str, set[str]]:
    """Module -> the rldiag.app modules it imports (every import, at any depth of the file)."""
    mods = {module_name(p): p for p in (REPO / "app").rglob("*.py") if "__pycache__" not in p.parts}
    graph: dict[str, set[str]] = defaultdict(set)
    for mod, path in mods.items():
        for _, target in imports(path):
            # the longest known module that `target` names (an imported name resolves to its module)
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target and target != mod and target != "rldiag.app":
                graph[mod].add(target)
    return graph


def layer(mod: str) -> str:
    parts = mod.split(".")
    return parts[2] if len(parts) > 2 else "package"


def test_app_layers_import_only_downwards():
    up = [f"{src} ({layer(src)}) imports {dst} ({layer(dst)})" for src, dsts in app_graph().items()
          for dst in dsts if layer(src) != "package" and layer(dst) != "package"
          and RANK[layer(dst)] > RANK[layer(src)] or (layer(src) == "watch" and layer(dst) == "report")
          or (layer(src) == "report" and layer(dst) == "watch")]
    assert not up, "imports against app/'s layering (" + " -> ".join(reversed(LAYERS)) + "):\n" + "\n".join(sorted(up))


def test_app_has_no_import_cycle():
    graph = app_graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]) if nxt in path else nxt)
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    assert not cycles, "import cycles in app/:\n" + "\n".join(cycles)


@pytest.mark.parametrize("folder", ["collectors", "experiments"])
def test_write_side_and_experiments_never_import_the_read_side(folder):
    bad = [f"{p.relative_to(REPO)}:{line}: {mod}" for p in (REPO / folder).rglob("*.py")
           for line, mod in imports(p) if mod.startswith("rldiag.app")]
    assert not bad, f"{folder}/ must not import rldiag.app:\n" + "\n".join(bad)


def test_the_watcher_and_the_detector_import_without_scipy():
    """.venv-trl11 installs rldiag with [hf,dev] only (a user's training env): its TRL test runs the watcher
    there, and CI failed once on a module-level `from scipy...` in the detector's calibration. scipy is
    blocked in a fresh interpreter; the read side's detector path must import and compute without it."""
    code = ("import sys; sys.modules['scipy'] = None\n"
            "import rldiag.app.watch.loop, rldiag.app.analysis.divergence\n"
            "from rldiag.app.analysis import calibration\n"
            "print(round(calibration.z_alpha(0.001, 100.0), 3))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert 4.0 < float(out.stdout) < 6.0, out.stdout
