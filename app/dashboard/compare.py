"""Compare: the canonical metrics of the picked runs overlaid, two charts a row, with where each
candidate leaves the reference (band of reference seeds) marked on the charts and listed above them.
"""

from __future__ import annotations

from dataclasses import replace

import pandas as pd
import plotly.io
import streamlit as st

from rldiag.app.analysis.causes import RunCauses
from rldiag.app.analysis.comparison import HEADLINE_METRICS, load_keys
from rldiag.app.analysis.divergence import (
    NOT_COMPARED,
    NOT_ENOUGH_STEPS,
    CandidateSummary,
    detectable_text,
)
from rldiag.app.analysis.verdicts import departure_sentence, departure_when, verdict_rows
from rldiag.app.dashboard import RLDIAG_REFRESH_S, data
from rldiag.app.dashboard.chart_grid import chart_grid
from rldiag.app.dashboard.html_table import html_table
from rldiag.app.dashboard.selection import (
    Selection,
    current,
    escape_md,
    label_list,
    needs_runs,
)
from rldiag.app.dashboard.worst_tokens import render_section as worst_token_section
from rldiag.app.data.histories import Histories
from rldiag.app.data.runs import runs_with_metrics
from rldiag.app.data.steps import format_ranges
from rldiag.app.plots.decimate import DEFAULT_POINTS
from rldiag.app.plots.figures import ChartOptions, metric_figure, run_colors, run_order
from rldiag.app.plots.grid_figure import grid_figure
from rldiag.app.report.content import (
    empty_text,
    evidence_parts,
    gap_parts,
    nonfinite_text,
    others_text,
    reference_empty_text,
    verdict_table_shown,
)
from rldiag.collectors import keys

PLOT_CONFIG = {"displaylogo": False, "scrollZoom": False}
# Line points per run and chart (300 buckets, each its min and max: every spike and dip is kept); a band trace
# takes half as many (app/plots/marks.py). A half-width panel is about 520 px wide: a bucket is under 2 px.
# 1200 drew 355k points for 10 runs x 8 metrics with 9 candidates' bands, 600 drew 113k, and 70k since a chart
# shades at most 3 bands (comparison.BANDS_PER_CHART; bench.dashboard_load).
CHART_POINTS = 600


def _controls(sel: Selection, available: list[str]) -> tuple[list[str], ChartOptions, bool]:
    """The page's controls, in one row above the verdicts (Chart options, Live refresh, Fetch new points); returns
    the metrics to draw, the chart options and whether to refresh live."""
    # what a headline prefers too (`divergence.HEADLINE_METRICS`): the report names the metric this page does
    defaults = [k for k in HEADLINE_METRICS if k in available] or available[:8]
    row = st.container(horizontal=True, vertical_alignment="center")
    # a popover, not an expander: the browser mounts a popover's widgets only when it opens, an expander's on
    # every page load, collapsed or not (bench.dashboard_load: 0.12 s of the renderer's 1.93 s CPU a warm load)
    with row.popover("Chart options"):
        chosen = st.multiselect("Metrics", available, default=defaults, key="compare.metrics")
        c1, c2, c3 = st.columns(3)
        delta = c1.toggle("Delta vs reference", key="compare.delta", disabled=not sel.reference_ids,
                          help="Each run minus the mean of the reference runs at the same step")
        log_y = c2.toggle("Log scale", key="compare.log")
        smoothing = c3.slider("Smoothing (EMA weight)", 0.0, 0.99, 0.0, 0.01, key="compare.smoothing",
                              help="TensorBoard's slider; 0 draws the raw points (every spike kept)")
        last = int(sel.picked_runs()["last_step"].max(skipna=True) or 0)
        first_step, last_step = (0, last)
        if last > 0:
            first_step, last_step = st.slider("Step range", 0, last, (0, last), key="compare.steps")
    live = row.toggle("Live refresh", value=sel.running, key="compare.live", disabled=not sel.running,
                      help="Fetch new points while a picked run is RUNNING (only what is new is read)")
    if row.button("Fetch new points", key="compare.refresh", help="Read rows written since the last load"):
        st.session_state["compare.force"] = True
    options = ChartOptions(delta=delta and bool(sel.reference_ids), smoothing=smoothing, log_y=log_y,
                           first=first_step if first_step > 0 else None,
                           last=last_step if last and last_step < last else None, n_points=CHART_POINTS)
    if live and sel.running:
        row.caption(f"Refreshing every {_interval()} s while a picked run is RUNNING.")
    return chosen, options, live and sel.running


def _interval() -> float:
    try:
        return max(2.0, RLDIAG_REFRESH_S.get_float())
    except ValueError:
        return 10.0


def _warn_unusable(sel: Selection) -> list[str]:
    """Warn about picked runs without any canonical metric (naming the keys they have); returns the rest."""
    picked = sel.picked_runs()
    ok = runs_with_metrics(picked)
    for r in picked[~ok].itertuples():
        have = ", ".join(r.metrics) if r.metrics else "no metrics at all"
        st.warning(f"Run **{escape_md(sel.labels[r.run_id])}** has none of rldiag's canonical metrics or their "
                   f"known aliases, so it is left out of the charts. It logged: {escape_md(have)}.",
                   icon=":material/help:")
    return picked.loc[ok, "run_id"].tolist()


def summary_line(s: CandidateSummary, label: str) -> str:
    """The page's line for one candidate (Markdown), in the report's words (`content.headline`): non-finite
    gradients first, then the metric it leaves that lasts and is largest, when (alert and onset) and by
    how much, the others, then how much the comparison rests on."""
    parts = [escape_md(t) for t in [nonfinite_text(s), empty_text(s)] if t]
    if s.first is not None:
        parts += [escape_md(t) for t in [departure_sentence(s.first.key, s.first.lead), others_text(s)] if t]
    parts += [escape_md(p) for p in evidence_parts(s)]
    return f"- **{escape_md(label)}**: " + "; ".join(parts)


def _divergence_summary(table: pd.DataFrame, summaries: list[CandidateSummary], labels, band: str,
                        causes: list[RunCauses] = ()) -> None:
    """One line per candidate (`summary_line`, its likely cause under it), the ranked causes and the full
    (candidate, metric) table of onsets on request: a data grid costs the page load most of a second in
    the browser, a few lines of text next to nothing."""
    lines = {rc.run_id: rc.line() for rc in causes}
    st.markdown("\n".join(summary_line(s, labels[s.run_id]) + (f"\n  - {escape_md(lines[s.run_id])}"
                                                                if lines.get(s.run_id) else "") for s in summaries))
    ranked = [rc for rc in causes if rc.causes]
    if ranked:
        # one Markdown element for every candidate, not one each: the browser renders every element on the
        # page's first draw, collapsed or not (nine at 10 runs)
        with st.expander("Likely causes, ranked, with their evidence", expanded=False):
            st.markdown("\n\n".join(f"**{escape_md(labels[rc.run_id])}**\n" + "\n".join(
                f"{i}. **{escape_md(c.title)}**{f' ({escape_md(c.hint)})' if c.hint else ''}: "
                f"{escape_md('; '.join([*c.signature, *c.settings]))}. Fix: {escape_md(c.fix)}. "
                f"Source: {escape_md(c.source)}" for i, c in enumerate(rc.causes, 1))
                + (f"\n\nAlso differs (no signature of its own): {escape_md('; '.join(rc.also_differs))}"
                   if rc.also_differs else "") for rc in ranked))
    needed = summaries[0].steps_needed if summaries else 0
    st.caption(f"Compared with {band}: each departure says the step a watcher polling every step alerts at and "
               "where it started (placed after the fact), also marked on the charts; a metric still out at the end "
               "leads one that came back, the larger first; a metric needs "
               f"{needed} compared steps before staying inside says anything.")
    if len(table) and st.toggle("Every departure (candidate x metric)", key="compare.divergence.all"):
        st.dataframe(table, hide_index=True, key="compare.divergence", column_config={
            "delta": st.column_config.NumberColumn(format="%.4g"),
            "size": st.column_config.TextColumn("size (vs reference)"),
            "delta_sigma": st.column_config.TextColumn("delta (sigma)")})


def page_keys(metric_keys: list[str]) -> tuple[str, ...]:
    """What the page loads: the charted metrics and what the verdict reads (`comparison.load_keys`, as the
    report and the watcher), in one histories entry (one read of the store, one entry in the caches)."""
    return load_keys(metric_keys)


def _charts(sel: Selection, run_ids: list[str], metric_keys: list[str], options: ChartOptions, live: bool) -> None:
    refs = [r for r in sel.reference_ids if r in run_ids]
    cands = [r for r in sel.candidate_ids if r in run_ids]
    force = st.session_state.pop("compare.force", False)
    with st.spinner("Loading metric histories..."):
        loaded = data.histories(sel.uri, run_ids, page_keys(metric_keys), live=live, force=force)
    h = loaded.histories
    version = data.runs_version(sel.runs, cands)
    # At a glance first (one line per page, the charts right under it: above the fold at 1280x800), then
    # each candidate's lines in full; filled in below, once everything is computed.
    glance, board = st.container(), st.container()
    colors = run_colors(run_ids, refs, order=run_order(sel.runs))  # from the run, not its place in the pick
    labels = tuple((r, sel.labels[r]) for r in run_ids)
    shown = [k for k in metric_keys if h.for_key(k, run_ids)]
    missing = [k for k in metric_keys if k not in shown]
    drawn = (sel.uri, tuple(run_ids), tuple(refs), tuple(cands), tuple(metric_keys))
    if missing:
        board.caption(f"No picked run logged: {escape_md(', '.join(missing))}.")
    waiting = slot = None
    # a comparison to compute (seconds at scale): the charts first, without marks, unless this session has
    # them drawn already (a live refresh keeps the drawn ones until the new ones replace them)
    if (refs and cands and shown and st.session_state.get("compare.drawn") != drawn
            and not data.comparison_cached(sel.uri, loaded, tuple(refs), tuple(cands), tuple(metric_keys), version)):
        # one element each: a container in a placeholder's place would keep the early one's elements
        waiting, slot = board.empty(), board.empty()
        waiting.caption("Verdicts being computed... the charts get each candidate's departure marks and band "
                        "once they are.")
        with slot:
            chart_grid(draft_grid(h, tuple(shown), tuple(run_ids), labels, tuple(refs), tuple(colors.items()),
                                  options), key="compare.charts.draft", config=PLOT_CONFIG)
    # the one comparison (the report's and the watcher's too): divergences, summaries, likely causes
    found = (data.comparison(sel.uri, loaded, tuple(refs), tuple(cands), tuple(metric_keys), version)
             if refs and cands else None)
    divs = found.divergences if found is not None else {}

    st.subheader("Where candidates leave the reference")
    if not refs:
        st.info("Pick a reference run in the sidebar to see where candidates depart from it.")
    elif not cands:
        st.info("Pick candidate runs in the sidebar to compare them with the reference.")
    else:
        table = data.divergence_rows(divs, sel.labels)
        summaries, causes = list(found.summaries), list(found.causes)
        # TRL's every-completion-truncated steps count as "no valid tokens" where its params mask them
        trl = tuple(r for r in (*refs, *cands) if h.get(r, keys.TRL_CLIPPED_RATIO) is not None)
        trl_params = {r: c.params for r, c in data.configs(sel.uri, trl).items()} if trl else {}
        band = f"a band of {len(refs)} reference runs" if len(refs) > 1 else "the reference run"
        if found.reference_note:
            st.caption(found.reference_note)
        if found.options_text != "defaults":  # as every report's header: an option that moves every verdict is said
            st.caption(f"Detector options: {escape_md(found.options_text)} (rldiag app --detector; the defaults "
                       "suit most runs).")
        if note := reference_empty_text(h, refs, sel.labels, trl_params):
            st.warning(note, icon=":material/warning:")
        if found.all_clear:  # finite and checked gradients, every metric in full on enough steps, no departure
            missed = detectable_text([d for s in summaries for d in s.within])  # what "within" could miss
            st.success(f"No candidate leaves {band} on the metrics shown{f' ({missed})' if missed else ''}.",
                       icon=":material/check:")
        else:
            _divergence_summary(table, summaries, sel.labels, band, causes)

    if refs and cands:
        glance.markdown(glance_line(summaries, sel.labels, len(refs)))
        # the why, before any chart: per candidate its verdict, where it departs, its likely cause and fix
        rows = verdict_rows(found, sel.labels)
        if verdict_table_shown(rows):  # a static table: the fix wraps, never cut
            # as HTML, not Markdown with HTML allowed: the page then needs no HTML-in-Markdown parser (188 KB of
            # the browser's scripts to load and run on every fresh page, and the table parsed through it)
            glance.html(html_table(pd.DataFrame(rows, columns=["candidate", "verdict", "departs", "likely cause",
                                                               "fix"])))
    if shown:
        figure = data.grid(loaded.stamp, h, tuple(shown), tuple(run_ids), labels, tuple(refs),
                           tuple(colors.items()), divs, options)
        if waiting is not None:
            waiting.empty()
        with slot if slot is not None else board:  # the full grid in the early one's place
            chart_grid(figure, key="compare.charts", config=PLOT_CONFIG)
    st.session_state["compare.drawn"] = drawn


def draft_grid(h: Histories, metric_keys: tuple[str, ...], run_ids: tuple[str, ...], labels: tuple[tuple[str, str], ...],
               reference_ids: tuple[str, ...], colors: tuple[tuple[str, str], ...], options: ChartOptions) -> str:
    """`data.grid`'s figure without departure marks or tested bands: what a first load draws while the
    comparison is computed. Not cached: drawn once, then replaced (decimating is a small part of a load)."""
    figures = [metric_figure(k, h.for_key(k, run_ids), labels=dict(labels), reference_ids=reference_ids,
                             colors=dict(colors), options=options).to_plotly_json() for k in metric_keys]
    return plotly.io.to_json(grid_figure(figures), validate=False)


def glance_line(summaries: list[CandidateSummary], labels, n_refs: int) -> str:
    """One Markdown line above the charts: how many candidates leave the reference and where each first
    does (non-finite gradients first); the full lines follow the charts."""
    band = f"the band of {n_refs} references" if n_refs > 1 else "the reference"
    leaving = [s for s in summaries if s.nonfinite_steps or s.first is not None]
    # no metric compared on enough steps: the comparison cannot tell, which is not "within"
    cannot = [s for s in summaries if s not in leaving and s.status in (NOT_ENOUGH_STEPS, NOT_COMPARED)]
    thin = [s for s in summaries if s not in leaving and s not in cannot and (s.thin or s.not_compared)]
    past = [s for s in summaries if s not in leaving and s not in cannot and s.past_references]
    by_order = [s for s in summaries if s not in cannot and s.by_order]  # logged with no step: logging order
    parts = []
    for s in leaving:
        where = nonfinite_text(s) or f"{s.first.key} {departure_when(s.first.lead)}"
        parts.append(f"**{escape_md(labels[s.run_id])}**: {escape_md(where)}")
    # every token masked at some steps: whatever the bands say, those steps measured nothing
    empty = [f"**{escape_md(labels[s.run_id])}**: no valid tokens at step{'s' if len(s.empty_steps) > 1 else ''} "
             f"{format_ranges(s.empty_steps, limit=4)}"
             for s in summaries if s.empty_steps]
    missed = detectable_text([d for s in summaries if s not in leaving for d in s.within])
    # compared, no departure, but short of an all-clear: a metric stops early or was never logged, gradients unchecked
    gaps = [f"**{escape_md(labels[s.run_id])}**: {escape_md('; '.join(g))}" for s in summaries
            if s not in leaving and s not in cannot and (g := gap_parts(s))]
    if leaving:
        head = f"**{len(leaving)} of {len(summaries)} candidates leave {band}**"
    elif gaps:
        head = f"**No departure from {band} found, but not an all-clear**: " + "; ".join(gaps)
    elif len(cannot) == len(summaries):
        needed = summaries[0].steps_needed if summaries else 0
        head = f"**Cannot tell whether a candidate leaves {band}**: too few compared steps ({needed} needed)"
    else:
        head = f"**No candidate leaves {band}**" + (f" ({escape_md(missed)})" if missed else "")
    tail = ((f"; **{len(cannot)} of {len(summaries)} cannot tell** (too few steps)" if cannot and len(cannot) < len(summaries)
             else "") + (f"; {len(thin)} with too few steps on some metrics" if thin else "")
            + (f"; {len(past)} logged past the references' last step (not compared there)" if past else "")
            + (f"; {len(by_order)} compared in logging order (metrics logged with no step)" if by_order else "")
            + ("; " + "; ".join(empty) if empty else ""))
    return head + (" — " + "; ".join(parts) if parts else "") + tail + ". Each candidate in full below the charts."


def render() -> None:
    sel = current()
    st.header("Compare")
    if not needs_runs(sel, "their metrics overlaid"):
        return
    st.caption(f"Reference: {label_list(sel, sel.reference_ids) or '(none)'} · "
               f"Candidates: {label_list(sel, sel.candidate_ids) or '(none)'}")
    run_ids = _warn_unusable(sel)
    if not run_ids:
        return
    available = data.available_metrics(sel.runs, run_ids)
    metric_keys, options, live = _controls(sel, available)
    if not metric_keys:
        st.info("Pick at least one metric under Chart options.")
        return

    @st.fragment(run_every=_interval() if live else None)
    def charts() -> None:
        _charts(sel, run_ids, metric_keys, options, live)

    charts()
    worst_token_section(sel, run_ids)
    _downloads(sel, run_ids, metric_keys, options)


def _downloads(sel: Selection, run_ids: list[str], metric_keys: list[str], options: ChartOptions) -> None:
    """The run-comparison report (rldiag.app.report.build) as HTML and Markdown, built only when asked (it embeds
    plotly.js and every chart: seconds, not for every rerun)."""
    refs = [r for r in sel.reference_ids if r in run_ids]
    cands = [r for r in sel.candidate_ids if r in run_ids]
    st.subheader("Report")
    if not (refs and cands):
        st.caption("Pick a reference and a candidate to build the run-comparison report.")
        return
    loaded = data.histories(sel.uri, run_ids, page_keys(metric_keys))
    wanted = (loaded.stamp, tuple(refs), tuple(cands), tuple(metric_keys), options)
    built = st.session_state.get("compare.report")
    if st.button("Build report (HTML + Markdown)", key="compare.report.build"):
        from rldiag.app.report.build import render_report

        with st.spinner("Rendering the report..."):
            try:
                report = render_report(loaded.histories, data.get_store(sel.uri), refs, cands, keys=metric_keys,
                                       options=replace(options, n_points=DEFAULT_POINTS))
            except ValueError as e:
                st.error(escape_md(str(e)))
                return
        built = (wanted, report.html, report.markdown)
        st.session_state["compare.report"] = built
    if built is None or built[0] != wanted:
        st.caption("Self-contained HTML (charts, divergence, NaN events, config diff) and a Markdown summary "
                   "of the runs and metrics picked here.")
        return
    c1, c2 = st.columns(2)
    c1.download_button("Download HTML report", built[1], file_name="rldiag-report.html", mime="text/html",
                       key="compare.report.html", on_click="ignore")
    c2.download_button("Download Markdown summary", built[2], file_name="rldiag-report.md", mime="text/markdown",
                       key="compare.report.md", on_click="ignore")
