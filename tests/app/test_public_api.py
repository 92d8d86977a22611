"""The read side's public surface (`rldiag.app.__all__`), pinned, and usable from a notebook: open a
store, find runs, load histories, detect divergence, build a report, watch once, no argparse."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import rldiag.app
from rldiag.collectors import keys
from tests.helpers.runs import write_run

REPO = Path(__file__).resolve().parents[2]

EXPECTED_ALL = [
    "CompareOptions",
    "Comparison",
    "DataError",
    "Divergence",
    "DivergenceConfig",
    "Histories",
    "Report",
    "Store",
    "build_report",
    "compare",
    "detect_divergence",
    "find_runs",
    "load_histories",
    "load_keys",
    "nan_events",
    "open_store",
    "render_report",
    "watch_once",
]


def test_all_is_pinned_and_every_name_loads_from_its_layer():
    # Adding or removing a public name is a deliberate change: update this list with it.
    assert sorted(rldiag.app.__all__) == EXPECTED_ALL
    for name in rldiag.app.__all__:
        assert getattr(rldiag.app, name).__module__.startswith("rldiag.app."), name
    with pytest.raises(AttributeError, match="module 'rldiag.app' has no attribute 'load_history'"):
        rldiag.app.load_history  # noqa: B018


def test_importing_the_read_side_loads_no_dashboard():
    code = ("import json, sys, rldiag.app\n"
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & {'streamlit', 'plotly', 'torch', 'mlflow'})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout) == []


def test_a_notebook_session_without_argparse(store_uri, tmp_path):
    from rldiag.app import (
        build_report,
        detect_divergence,
        find_runs,
        load_histories,
        open_store,
        watch_once,
    )

    ok = write_run(store_uri, name="ok", tags={keys.TAG_GROUP: "g", keys.TAG_ROLE: "reference"},
                   steps=[(s, {keys.RATIO_MEAN: 1.0 + 0.01 * (s % 3), keys.GRAD_NORM: 1.0}) for s in range(40)])
    bad = write_run(store_uri, name="bad", tags={keys.TAG_GROUP: "g", keys.TAG_ROLE: "candidate"},
                    steps=[(s, {keys.RATIO_MEAN: 1.0 if s < 20 else 1.5,
                                keys.GRAD_NORM: float("nan") if s == 30 else 1.0}) for s in range(40)])
    store = open_store(store_uri)
    runs = find_runs(store, group="g")
    assert set(runs.run_id) == {ok, bad}
    h = load_histories(store, [ok, bad], [keys.RATIO_MEAN])
    d = detect_divergence(h.get(ok, keys.RATIO_MEAN), h.get(bad, keys.RATIO_MEAN))
    assert d.diverged and 19 <= d.onset_step <= 22
    report = build_report(store_uri, group="g")
    assert "<html" in report.html.lower() and "bad" in report.markdown
    result, events = watch_once(store)
    assert result.runs == 2 and [(e["run_id"], e["step"]) for e in events] == [(bad, 30)]
    with pytest.raises(TypeError, match=r"open_store\(uri\)"):
        find_runs(store_uri)  # a URI where a Store is expected: the message says the fix
