"""Runs overview: every run of the experiment with its status, steps, alerts and rldiag tags."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from rldiag.app.dashboard.selection import Selection, current, escape_md, needs_runs
from rldiag.app.data.runs import runs_with_metrics

COLUMNS = {  # overview column -> header
    "name": "run", "status": "status", "last_step": "steps", "alerts": "alerts", "first_alert_step": "first alert step",
    "variant": "variant", "role": "role", "group": "group", "seed": "seed", "start_time": "started (UTC)",
    "n_metrics": "canonical metrics", "run_id": "run id",
}


def overview_table(sel: Selection) -> pd.DataFrame:
    """The rows the page shows: one per run, newest first, picked runs marked."""
    runs = sel.runs.copy()
    runs["name"] = runs["run_id"].map(sel.labels)
    runs["n_metrics"] = runs["metrics"].map(len)
    table = runs[list(COLUMNS)].rename(columns=COLUMNS)
    table.insert(1, "picked", runs["run_id"].map(
        lambda r: "reference" if r in sel.reference_ids else "candidate" if r in sel.candidate_ids else ""))
    return table


def render() -> None:
    sel = current()
    st.header("Runs")
    if sel.runs is None:  # no experiment, or an empty one: needs_runs says which
        needs_runs(sel, "runs")
        return
    runs = sel.runs
    c = st.columns(4)
    c[0].metric("runs", len(runs))
    c[1].metric("running", int((runs["status"] == "RUNNING").sum()))
    c[2].metric("runs with alerts", int((runs["alerts"] > 0).sum()))
    c[3].metric("picked", len(sel.picked))
    st.dataframe(overview_table(sel), hide_index=True, key="overview.table", column_config={
        "steps": st.column_config.NumberColumn(format="%d"),
        "alerts": st.column_config.NumberColumn(help="non-finite gradient alerts rldiag's collectors raised"),
        "started (UTC)": st.column_config.DatetimeColumn(format="YYYY-MM-DD HH:mm:ss"),
    })
    without = runs[~runs_with_metrics(runs)]
    for r in without.itertuples():
        have = ", ".join(r.metrics) if r.metrics else "no metrics at all"
        st.warning(f"Run **{escape_md(sel.labels[r.run_id])}** logged none of rldiag's canonical metrics "
                   f"(nor a known alias), so the comparison has nothing to draw for it. It has: "
                   f"{escape_md(have)}.", icon=":material/help:")
    if sel.running:
        st.caption("A picked run is RUNNING: the Compare page refreshes while it runs.")
