"""What a run-comparison report says, computed once from loaded histories; `rldiag.app.report.html` and
`rldiag.app.report.markdown` only format it.

    content = report_content(histories, store, reference_ids, candidate_ids)
    content.divergence   # one row per (candidate, metric): onset step, kind, size of the departure
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from rldiag.app.analysis.config_diff import RunConfig, config_diff
from rldiag.app.analysis.divergence import (
    DivergenceConfig,
    compare_runs,
    divergence_frame,
)
from rldiag.app.analysis.nan_events import nan_events
from rldiag.app.data.alerts import load_alert_events
from rldiag.app.data.histories import Histories, nonfinite_table
from rldiag.app.data.store import Store
from rldiag.app.plots.figures import ChartOptions, metric_figure, run_colors
from rldiag.collectors import keys as K
from rldiag.collectors.uri import redact_uri


@dataclass(frozen=True)
class RunInfo:
    """One run of the report, as its tables and legends name it."""

    run_id: str
    name: str
    label: str  # unique within the report: the name, or "name (id prefix)" where names repeat
    role: str  # "reference" or "candidate" (in this report, whatever the run's tag says)
    color: str
    variant: str | None
    seed: str | None
    group: str | None
    status: str


@dataclass(frozen=True)
class ReportContent:
    title: str
    store_uri: str  # without a password
    generated_utc: str
    runs: tuple[RunInfo, ...]  # references first, then candidates
    keys: tuple[str, ...]  # the metrics charted and compared, in canonical order
    divergence: pd.DataFrame  # DIVERGENCE_COLUMNS, one row per (candidate, metric both sides logged)
    nan_events: pd.DataFrame  # rldiag.app.analysis.nan_events.COLUMNS
    nonfinite: pd.DataFrame  # rldiag.app.data.histories.nonfinite_table, every charted metric
    config_diff: pd.DataFrame  # rldiag.app.analysis.config_diff.config_diff, columns group, kind, name, <labels>
    figures: dict[str, object]  # key -> plotly Figure

    @property
    def labels(self) -> dict[str, str]:
        return {r.run_id: r.label for r in self.runs}

    @property
    def reference_ids(self) -> tuple[str, ...]:
        return tuple(r.run_id for r in self.runs if r.role == "reference")

    @property
    def candidate_ids(self) -> tuple[str, ...]:
        return tuple(r.run_id for r in self.runs if r.role == "candidate")


def default_keys(histories: Histories, run_ids: Sequence[str]) -> list[str]:
    """The canonical metrics that at least one of `run_ids` logged, in canonical order."""
    have = {k for r, k in histories.traces if r in set(run_ids)}
    return [k for k in K.CANONICAL_METRICS if k in have]


def check_ids(histories: Histories, reference_ids: Sequence[str], candidate_ids: Sequence[str]) -> None:
    """ValueError naming the bad ids: none given, both roles, or not loaded in `histories`."""
    if not reference_ids:
        raise ValueError("no reference run: pass at least one reference run id (--reference RUN_ID or --group G)")
    if not candidate_ids:
        raise ValueError("no candidate run: pass --candidate RUN_ID, or tag runs rldiag.role=candidate in the group")
    both = sorted(set(reference_ids) & set(candidate_ids))
    if both:
        raise ValueError(f"run id(s) {both} are given as both reference and candidate; keep each in one role")
    loaded = set(histories.run_ids)
    missing = [r for r in [*reference_ids, *candidate_ids] if r not in loaded]
    if missing:
        raise ValueError(f"run id(s) {missing} are not in the loaded histories (it holds {list(histories.run_ids)}); "
                         "load them with rldiag.app.data.histories.load_histories first")


def report_content(histories: Histories, store: Store, reference_ids: Sequence[str], candidate_ids: Sequence[str],
                   *, keys: Sequence[str] | None = None, options: ChartOptions | None = None,
                   divergence_config: DivergenceConfig = DivergenceConfig()) -> ReportContent:
    """Everything the report shows; see the module docstring. Reads run names, params, tags and alert
    files from `store` (the metrics come from `histories`)."""
    from rldiag.app.data.runs import get_runs, run_labels

    refs, cands = list(dict.fromkeys(reference_ids)), list(dict.fromkeys(candidate_ids))
    check_ids(histories, refs, cands)
    ids = refs + cands
    keys = [K.canonical_key(k) for k in keys] if keys is not None else default_keys(histories, ids)
    options = options or ChartOptions()

    runs = get_runs(store, ids)
    labels = run_labels({r.info.run_id: r.info.run_name for r in runs})
    colors = run_colors(ids, refs)
    tags = {r.info.run_id: dict(r.data.tags) for r in runs}
    infos = tuple(RunInfo(r.info.run_id, r.info.run_name or "", labels[r.info.run_id],
                          "reference" if r.info.run_id in refs else "candidate", colors[r.info.run_id],
                          tags[r.info.run_id].get(K.TAG_VARIANT), tags[r.info.run_id].get(K.TAG_SEED),
                          tags[r.info.run_id].get(K.TAG_GROUP), r.info.status) for r in runs)

    divergences = compare_runs(histories, refs, cands, keys, divergence_config)
    divergence = divergence_frame(divergences)

    figures = {key: metric_figure(key, histories.for_key(key, ids), labels=labels, reference_ids=refs,
                                  colors=colors, divergences=divergences.get(key, {}), options=options) for key in keys}

    alerts = load_alert_events(store, ids, tags=tags)
    events = nan_events(histories, store, ids, alerts=alerts)
    nonfinite = nonfinite_table(histories, ids)
    nonfinite = nonfinite[nonfinite["key"].isin(keys)].reset_index(drop=True)
    configs = {r.info.run_id: RunConfig(dict(r.data.params), tags[r.info.run_id]) for r in runs}
    diff = config_diff(configs, labels=labels)

    groups = sorted({i.group for i in infos if i.group})
    title = (f"group {', '.join(groups)}: " if groups else "") + f"{len(cands)} candidate(s) vs {len(refs)} reference(s)"
    return ReportContent(title, redact_uri(store.uri), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), infos,
                         tuple(keys), divergence, events, nonfinite, diff, figures)


# ---- formatting shared by the HTML and Markdown renderers ------------------------------------------
def fmt(v, digits: int = 4) -> str:
    """A table cell: "-" for missing/NaN, integers as such, floats to `digits` significant digits."""
    if v is None:
        return "-"
    if isinstance(v, (bool, np.bool_)):
        return str(bool(v))
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    if isinstance(v, (float, np.floating)):
        if math.isnan(v):
            return "-"
        if math.isinf(v):
            return "+inf" if v > 0 else "-inf"
        return f"{v:.{digits}g}"
    return str(v)


def fmt_value(v) -> str:
    """A config value: "(missing)" where the run does not have it."""
    return "(missing)" if v is None else str(v)


def divergence_sentence(row: dict, label: str) -> str:
    """One line: where a candidate leaves the band of a metric, and by how much (plain text)."""
    if row["onset_step"] is None:
        return f"{label}: {row['key']} stays within the reference band"
    if row["kind"] == "nonfinite":
        size = "non-finite where the references are finite"
    else:
        size = f"delta {fmt(row['delta'], 3)} ({fmt(row['delta_sigma'], 3)} sigma)"
    end = "" if row["end_step"] is None else f" to step {row['end_step']}"
    return f"{label}: {row['key']} leaves the reference band at step {row['onset_step']}{end} ({row['kind']}, {size})"


def first_departures(content: ReportContent) -> list[tuple[str, dict | None]]:
    """Per candidate (in order): its earliest departure row, or None when it stays in every band."""
    out = []
    div = content.divergence
    for run in content.candidate_ids:
        rows = [r for r in div[div["run_id"] == run].to_dict("records") if r["onset_step"] is not None]
        out.append((run, min(rows, key=lambda r: r["onset_step"]) if rows else None))
    return out
