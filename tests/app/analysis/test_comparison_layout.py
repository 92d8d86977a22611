"""One comparison (issue 41): the products (the report, the dashboard, the watcher) call
`rldiag.app.analysis.comparison.compare` and only render; none calls the detector or the likely
causes itself. An AST scan of their source: imports and names, wherever they appear."""

from __future__ import annotations

import ast
from pathlib import Path

APP = Path(__file__).resolve().parents[3] / "app"
PRODUCTS = ("report", "dashboard", "watch")
# the comparison's own parts: only `compare` puts them together
# the detector and its parts (02d0990 split it), and the causes' signatures
FORBIDDEN_MODULES = {f"rldiag.app.analysis.{m}" for m in (
    "detector", "reference_model", "reference_bars", "trailing_stats", "noise_transforms", "zero_rate",
    "causes_signatures")}
FORBIDDEN_NAMES = {"compare_runs", "summarize", "likely_causes", "detect_divergence", "compute_band",
                   "with_overflow_hints", "with_truncation_hints", "departures_after_updates", "nonfinite_signature"}


def _uses(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.module in FORBIDDEN_MODULES:
                found.append(f"from {node.module} import ...")
            found += [f"import {a.name}" for a in node.names if a.name in FORBIDDEN_NAMES]
        elif isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name in FORBIDDEN_MODULES]
        elif isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_NAMES:
            found.append(f".{node.attr}")
        elif isinstance(node, ast.Name) and node.id in FORBIDDEN_NAMES:
            found.append(node.id)
    return found


def test_products_call_compare_not_the_detector_or_the_causes():
    files = [f for p in PRODUCTS for f in sorted((APP / p).rglob("*.py"))]
    assert len(files) > 10, files  # the scan reads the products' source
    bad = {str(f.relative_to(APP)): u for f in files if (u := _uses(ast.parse(f.read_text(), str(f))))}
    assert bad == {}, f"call rldiag.app.analysis.comparison.compare instead: {bad}"


def test_the_scan_catches_a_direct_call():
    src = ("from rldiag.app.analysis.divergence import compare_runs\nimport rldiag.app.analysis.detector\n"
           "from rldiag.app.analysis import causes\ncauses.likely_causes(h, {}, [], [])\n")
    assert _uses(ast.parse(src)) == ["import compare_runs", "import rldiag.app.analysis.detector", ".likely_causes"]
