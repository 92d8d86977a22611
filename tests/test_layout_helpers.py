"""Test helpers live in one package, tests/helpers/: a test module or conftest file imports no other test
module, no conftest and nothing from bench/ (an AST scan of every import, also inside functions and in the
scripts tests run in a fresh interpreter); tests/helpers/ imports no test module and defines no fixture."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
HELPERS = TESTS / "helpers"
# An import line inside a script a test runs (a string constant), e.g. "from tests.x import y".
SCRIPT_IMPORT = re.compile(r"^\s*(?:from|import)\s+((?:tests|bench)(?:\.\w+)*)", re.MULTILINE)


def _imported(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every import in `tree`, relative ones as '.'-prefixed; `from bench import x` gives 'bench'."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append((node.lineno, "." * node.level + (node.module or "")))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            out += [(node.lineno, m) for m in SCRIPT_IMPORT.findall(node.value)]
    return out


def violations(source: str, in_helpers: bool) -> list[str]:
    """What `source` (a file under tests/) imports that it should not: a relative import, a test module or
    conftest (anything under `tests` but `tests.helpers`), or `bench` (allowed in tests/helpers only); and
    in tests/helpers, a fixture."""
    tree = ast.parse(source)
    bad = []
    for line, mod in _imported(tree):
        top = mod.split(".")[0]
        if mod.startswith("."):
            bad.append(f"line {line}: relative import {mod!r} (import tests.helpers.<module> instead)")
        elif top == "tests" and not (mod == "tests.helpers" or mod.startswith("tests.helpers.")):
            bad.append(f"line {line}: imports {mod!r} (move what it uses into tests/helpers/)")
        elif top == "bench" and not in_helpers:
            bad.append(f"line {line}: imports {mod!r} (import it in a tests/helpers module, then from there)")
    if in_helpers:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                    "fixture" in ast.unparse(d) for d in node.decorator_list):
                bad.append(f"line {node.lineno}: fixture {node.name!r} (fixtures stay in conftest files)")
    return bad


def test_the_scan_flags_each_kind_of_import_it_forbids():
    source = '''
import bench.divergence_rl as rl
from tests.app.conftest import write_run
from tests.helpers.runs import write_run as ok
from . import sibling
def f():
    from tests.collectors.test_amp import mlp
SCRIPT = """
from tests.tiny_hf import save_tiny_qwen2
from tests.helpers.tiny_hf import save_tiny_qwen2
"""
'''
    found = violations(source, in_helpers=False)
    assert [v.split(":")[0] for v in found] == ["line 2", "line 3", "line 5", "line 7", "line 8"], found
    assert violations("import bench.x\nfrom tests.helpers import net\n", in_helpers=True) == []
    fixture = "import pytest\n@pytest.fixture(scope='module')\ndef store():\n    return 1\n"
    assert violations(fixture, in_helpers=True) == ["line 3: fixture 'store' (fixtures stay in conftest files)"]


# Every Python file under tests/ but this one (its scan test holds the forbidden imports as examples).
FILES = sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts and p != Path(__file__).resolve())


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(TESTS)) for p in FILES])
def test_tests_import_shared_code_from_tests_helpers_only(path: Path):
    in_helpers = HELPERS in path.parents
    assert violations(path.read_text(encoding="utf-8"), in_helpers) == [], path.relative_to(TESTS.parent)


def test_tests_helpers_holds_only_helper_modules():
    names = sorted(p.name for p in HELPERS.glob("*.py"))
    assert "conftest.py" not in names and not [n for n in names if n.startswith("test_")], names
