"""`rldiag report`: an offline run-comparison report, one self-contained HTML file and a Markdown summary.

    rldiag report --group v0_vs_v1                      # references/candidates from rldiag.role tags
    rldiag report --reference RUN_A --candidate RUN_B --out reports/

    report = build_report(uri, group="v0_vs_v1")        # find the runs, load, render
    report = render_report(histories, store, refs, cands)   # on histories already loaded (the dashboard)
    report.html, report.markdown, report.divergence

The HTML overlays every compared metric (`rldiag.app.plots.figures.metric_figure`: spikes kept, NaN/inf as markers,
divergence onsets marked), then the divergence table, the non-finite gradient events and the config
diff; the Markdown says the same in tables fit for a pull-request comment.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from rldiag.app.analysis.comparison import load_keys
from rldiag.app.analysis.divergence import DivergenceConfig
from rldiag.app.data.histories import Histories
from rldiag.app.data.store import Store, open_store, require_store
from rldiag.app.plots.figures import ChartOptions
from rldiag.app.report.content import ReportContent, default_keys, report_content
from rldiag.app.report.html import render_html
from rldiag.app.report.markdown import render_markdown
from rldiag.app.report.names import DEFAULT_HTML, DEFAULT_MARKDOWN, EXAMPLES  # noqa: F401 - re-exported
from rldiag.collectors import keys as K


@dataclass(frozen=True)
class Report:
    """A rendered report: `html` (self-contained page), `markdown` (PR comment), and what they show."""

    html: str
    markdown: str
    content: ReportContent

    @property
    def divergence(self):
        """DataFrame, one row per (candidate, metric): run_id, key, onset_step, kind, end_step, delta, ..."""
        return self.content.divergence

    @property
    def summaries(self):
        """Per candidate, `rldiag.app.analysis.divergence.CandidateSummary`: non-finite gradients, departures,
        the metrics with not enough steps or not compared, metrics that stop early."""
        return self.content.summaries

    @property
    def nan_events(self):
        """DataFrame of `rldiag.app.analysis.nan_events.nan_events` for every run of the report."""
        return self.content.nan_events

    @property
    def config_diff(self):
        """DataFrame of `rldiag.app.analysis.config_diff.config_diff` (differing params and tags; one column per run label)."""
        return self.content.config_diff

    @property
    def figures(self) -> dict:
        """`{metric key: plotly Figure}` as charted."""
        return self.content.figures

    @property
    def labels(self) -> dict[str, str]:
        return self.content.labels

    def write(self, html_path: str | Path | None = None, markdown_path: str | Path | None = None) -> list[Path]:
        """Write the HTML and/or Markdown (parent folders created); returns the paths written."""
        out = []
        for path, text in ((html_path, self.html), (markdown_path, self.markdown)):
            if path is not None:
                p = Path(path)
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_text(text, encoding="utf-8")
                out.append(p)
        return out


def render_report(histories: Histories, store: Store, reference_ids: Sequence[str],
                  candidate_ids: Sequence[str], *, keys: Sequence[str] | None = None,
                  options: ChartOptions | None = None, plotly_src: str | None = None) -> Report:
    """The report for runs whose metrics are already in `histories`; `store` gives their names, params,
    tags and alert files. `keys`: the metrics to chart and compare (default: the canonical ones any of
    the runs logged). ValueError names ids that are missing, empty or in both roles."""
    require_store(store)
    content = report_content(histories, store, reference_ids, candidate_ids, keys=keys, options=options,
                             divergence_config=DivergenceConfig.from_env())
    return Report(render_html(content, plotly_src=plotly_src), render_markdown(content), content)


def _ids(v: str | Sequence[str] | None) -> list[str]:
    return [] if v is None else [v] if isinstance(v, str) else list(dict.fromkeys(v))


def resolve_runs(store: Store, *, reference: str | Sequence[str] | None = None,
                 candidates: str | Sequence[str] | None = None, group: str | None = None,
                 experiment: str | None = None):
    """(reference ids, candidate ids, runs DataFrame of `rldiag.app.data.runs.find_runs`) for the given selection.

    Explicit ids win; otherwise a group's runs tagged rldiag.role=reference / candidate. Raises
    DataError (from find_runs) or ValueError, each naming the value and the fix."""
    from rldiag.app.data.runs import find_runs, resolve_run_refs

    refs = resolve_run_refs(store, _ids(reference), experiments=experiment)  # names and id prefixes too
    cands = resolve_run_refs(store, _ids(candidates), experiments=experiment)
    if not refs and group is None:
        raise ValueError("say which runs to compare: --reference RUN_ID (repeatable) or --group G "
                         "(runs tagged rldiag.group=G, with rldiag.role=reference / candidate)")
    both = [r for r in refs if r in set(cands)]
    if both:
        raise ValueError(f"run id(s) {both} are given as both reference and candidate; keep each in one role")
    frames = []
    if group is not None:
        runs = find_runs(store, experiments=experiment, group=group)
        frames.append(runs)
        roles = dict(zip(runs["run_id"], runs["role"]))
        if not refs:
            refs = [r for r, role in roles.items() if role == "reference"][::-1]  # oldest first
            if not refs:
                raise ValueError(
                    f"group {group!r} has no run tagged {K.TAG_ROLE}=reference (its {len(roles)} run(s) have roles "
                    f"{sorted({str(v) for v in roles.values()})}); tag the reference run(s) or pass --reference RUN_ID")
        if not cands:
            cands = [r for r, role in roles.items() if role == "candidate" and r not in refs][::-1]
            if not cands:
                raise ValueError(f"group {group!r} has no run tagged {K.TAG_ROLE}=candidate; tag them or pass "
                                 "--candidate RUN_ID")
    explicit = [r for r in [*refs, *cands] if not frames or r not in set(frames[0]["run_id"])]
    if explicit:
        frames.append(find_runs(store, experiments=experiment, run_ids=explicit))  # RunNotFound names bad ids
    if not cands:
        raise ValueError("no candidate run: pass --candidate RUN_ID (repeatable), or --group G to take the "
                         f"group's runs tagged {K.TAG_ROLE}=candidate")
    import pandas as pd

    runs = pd.concat(frames, ignore_index=True).drop_duplicates("run_id")
    missing = [r for r in [*refs, *cands] if r not in set(runs["run_id"])]
    if missing:  # e.g. a run of another experiment than --experiment
        raise ValueError(f"run id(s) {missing} are not active runs of experiment {experiment!r}; "
                         "drop --experiment or check the ids")
    return refs, cands, runs


def build_report(tracking_uri: str | None = None, *, reference: str | Sequence[str] | None = None,
                 candidates: str | Sequence[str] | None = None, group: str | None = None,
                 experiment: str | None = None, keys: Sequence[str] | None = None,
                 options: ChartOptions | None = None, progress: Callable[[str], None] | None = None,
                 plotly_src: str | None = None) -> Report:
    """Find the runs (`resolve_runs`), load their histories and render the report.

    `keys` default: the canonical metrics any of the runs logged. `progress` receives one line per
    stage. Raises DataError (store, experiment, run ids) or ValueError (selection, metrics)."""
    say = progress or (lambda _msg: None)
    t0 = time.monotonic()
    store = open_store(tracking_uri)
    refs, cands, runs = resolve_runs(store, reference=reference, candidates=candidates, group=group,
                                     experiment=experiment)
    ids = refs + cands
    present = {k for ms in runs["metrics"] for k in ms}
    if keys is None:
        keys = [k for k in K.CANONICAL_METRICS if k in present]
        if not keys:
            raise ValueError(f"none of the runs {ids} logged a canonical metric ({', '.join(K.CANONICAL_METRICS[:4])}, "
                             "...); pass --metrics KEY,KEY with keys they logged")
    else:
        keys = list(dict.fromkeys(K.canonical_key(k) for k in keys))
        absent = [k for k in keys if k not in present]
        if absent:
            raise ValueError(f"metric(s) {absent} were logged by none of the runs; they logged: "
                             f"{sorted(present)}")
    say(f"{len(refs)} reference(s), {len(cands)} candidate(s); loading {len(keys)} metric(s) of {len(ids)} runs ...")
    # the charted metrics and what the verdict reads (gradient flags, grad/found, the scaler, the worst token,
    # the causes' signatures): the one list the dashboard and the watcher load too
    histories = _load(store, ids, list(load_keys(keys)))
    n = sum(len(t) for t in histories.traces.values())
    say(f"loaded {n:,} points in {time.monotonic() - t0:.1f} s; comparing and drawing ...")
    report = render_report(histories, store, refs, cands, keys=keys, options=options, plotly_src=plotly_src)
    say(f"report built in {time.monotonic() - t0:.1f} s")
    return report


def _load(store: Store, ids: list[str], keys: list[str]) -> Histories:
    from rldiag.app.data.histories import load_histories

    return load_histories(store, ids, keys)


def departure_lines(report: Report) -> list[str]:
    """Per candidate, one plain-text line (`rldiag.app.report.content.headline`): non-finite gradients
    first, then its first departure from the references, then how much the comparison rests on; under
    it, indented, its likely cause (`rldiag.app.analysis.causes.RunCauses.line`) where one is said."""
    from rldiag.app.report.content import headline

    labels = report.labels
    causes = {c.run_id: c.line() for c in report.content.causes}
    out = []
    for s in report.content.summaries:
        out.append(headline(s, labels[s.run_id]))
        if causes.get(s.run_id):
            out.append(f"  {causes[s.run_id]}")  # its likely cause, under its line
    return out


__all__ = ["Report", "build_report", "render_report", "resolve_runs", "default_keys", "departure_lines"]
