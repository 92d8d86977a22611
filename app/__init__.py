"""rldiag's read side: load runs from any MLflow store, compare them, report, watch, and the dashboard.

    from rldiag.app import open_store, find_runs, load_histories, detect_divergence, build_report
    store = open_store("sqlite:///mlruns.db")
    runs = find_runs(store, experiments="distill")
    h = load_histories(store, runs.run_id.tolist(), load_keys(["policy/ratio_mean"]))
    c = compare(h, refs, cands)          # per candidate: status, departures, evidence, likely causes
    report = build_report("sqlite:///mlruns.db", group="v0_vs_v1")    # .html, .markdown, .divergence
    result, events = watch_once("sqlite:///mlruns.db")                # one watcher cycle and its events

Layers (each imports only those below it): cli -> dashboard | report | watch -> plots -> analysis ->
data -> errors; `rldiag.collectors` (keys, alert sinks) sits below them all. Needs the `app` extra
(`pip install 'rldiag[app]'`); each name loads its module on first use.
"""

from typing import TYPE_CHECKING

from rldiag.collectors.lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "DataError": "rldiag.app.errors",
    "Store": "rldiag.app.data.store",
    "open_store": "rldiag.app.data.store",
    "find_runs": "rldiag.app.data.runs",
    "Histories": "rldiag.app.data.histories",
    "Comparison": "rldiag.app.analysis.comparison",
    "CompareOptions": "rldiag.app.analysis.comparison",
    "compare": "rldiag.app.analysis.comparison",
    "load_keys": "rldiag.app.analysis.comparison",
    "load_histories": "rldiag.app.data.histories",
    "Divergence": "rldiag.app.analysis.divergence",
    "DivergenceConfig": "rldiag.app.analysis.divergence",
    "detect_divergence": "rldiag.app.analysis.divergence",
    "nan_events": "rldiag.app.analysis.nan_events",
    "Report": "rldiag.app.report.build",
    "build_report": "rldiag.app.report.build",
    "render_report": "rldiag.app.report.build",
    "watch_once": "rldiag.app.watch.loop",
}

if TYPE_CHECKING:  # what static tools see
    from rldiag.app.analysis.comparison import CompareOptions, Comparison, compare, load_keys
    from rldiag.app.analysis.divergence import (
        Divergence,
        DivergenceConfig,
        detect_divergence,
    )
    from rldiag.app.analysis.nan_events import nan_events
    from rldiag.app.data.histories import Histories, load_histories
    from rldiag.app.data.runs import find_runs
    from rldiag.app.data.store import Store, open_store
    from rldiag.app.errors import DataError
    from rldiag.app.report.build import Report, build_report, render_report
    from rldiag.app.watch.loop import watch_once

__all__ = [
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

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
