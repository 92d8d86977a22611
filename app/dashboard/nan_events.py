"""NaN events: per picked run, the steps with non-finite gradients, the parameters and the samples and
tokens the alerts name (`rldiag.app.analysis.nan_events`); any run shows its steps, rldiag's alerts add the rest.

One row per run and episode of consecutive bad steps (`rldiag.app.report.nan_episodes`), as a static
table whose text wraps (`html_table`: a data grid cuts long cells); every step of an episode in an
expander under it.
"""

from __future__ import annotations

import pandas as pd
import streamlit as st

from rldiag.app.analysis.nan_events import nan_events, unchecked_steps, unchecked_text
from rldiag.app.analysis.step_events import scaler_overflows, step_event_lines
from rldiag.app.dashboard import data
from rldiag.app.dashboard.html_table import html_table
from rldiag.app.dashboard.selection import Selection, current, escape_md, needs_runs
from rldiag.app.data.histories import nonfinite_table
from rldiag.app.report.content import fmt
from rldiag.app.report.nan_episodes import Episode, nan_episodes, origin_text
from rldiag.collectors import keys

# the fp16 scaler's keys: its overflows are said apart from the NaN steps (rldiag.app.analysis.step_events)
GRAD_KEYS = (keys.GRAD_FINITE, keys.GRAD_NORM, keys.GRAD_FOUND, keys.LOSS, keys.LOSS_UNFILTERED,
             keys.GRAD_SCALER_OVERFLOW, keys.GRAD_LOSS_SCALE)
MAX_EXPANDERS = 50  # episodes with their per-step detail; the rest are in the table only
MAX_STATIC_ROWS = 200  # a per-step detail longer than this is a (scrolling) data grid


def event_table(sel: Selection, events: pd.DataFrame) -> pd.DataFrame:
    """The events with run names, as the page shows them: the grad norm as text, so that NaN and inf
    read "NaN" and "inf" (a float column reaches the browser with NaN as a null: "None")."""
    out = events.copy()
    out.insert(0, "run", out.pop("run_id").map(sel.labels))
    out["grad_norm"] = [fmt(float(v)) for v in out["grad_norm"]]
    out["n_params"] = out["n_params"].astype("Int64")  # None where only the metrics tell
    return out.rename(columns={"grad_norm": "grad norm", "n_params": "# params", "positions": "samples / tokens"})


def episode_table(sel: Selection, episodes: list[Episode], alerts: dict | None = None) -> pd.DataFrame:
    """One row per episode, as the page shows it (a static table: its text wraps, nothing is cut)."""
    table = pd.DataFrame({
        "run": [sel.labels[ep.run_id] for ep in episodes],
        "steps": [ep.steps_text for ep in episodes],
        "steps (count)": [len(ep.rows) for ep in episodes],
        "grad norm": [ep.norm_text for ep in episodes],
        "parameters": [ep.params_text for ep in episodes],
        "samples / tokens": [ep.positions_text for ep in episodes],
        "source": [ep.source_text for ep in episodes],
    })
    skipped = [ep.skipped_text for ep in episodes]
    if any(x != "-" for x in skipped):  # whether the weights changed there, once the run said it
        table.insert(4, "optimizer", skipped)
    origins = [origin_text(ep, alerts) for ep in episodes]
    if any(o != "-" for o in origins):  # where the NaN entered, once the collectors said it
        table.insert(4, "where it entered", origins)
    return table


def _episodes(sel: Selection, events: pd.DataFrame, h, alerts: dict) -> None:
    episodes = nan_episodes(events, h, list(sel.picked))
    st.subheader("Steps with non-finite gradients")
    st.markdown(html_table(episode_table(sel, episodes, alerts), numeric=("steps (count)",)), unsafe_allow_html=True)
    st.caption("One row per run and stretch of consecutive non-finite steps; every step under it. `source`: "
               "`alerts` from the run's rldiag/alerts.jsonl, `tag` from its last-alert tag (while it runs), "
               "`metrics` from grad/finite or a NaN/inf grad norm (any trainer).")
    for i, ep in enumerate(episodes[:MAX_EXPANDERS]):
        with st.expander(f"{sel.labels[ep.run_id]}, {ep.steps_label}: every step", expanded=False):
            if ep.same_params:
                at = "at every step" if len(ep.rows) > 1 else "at this step"
                st.caption(f"Parameter tensors ({len(ep.params)}, {at}): " + escape_md(", ".join(ep.params)))
            detail = event_table(sel, ep.rows).drop(columns=["run"])
            if ep.same_params:
                detail = detail.drop(columns=["params", "# params"])
            if len(detail) <= MAX_STATIC_ROWS:
                st.markdown(html_table(detail, numeric=("step", "grad norm")), unsafe_allow_html=True)
            else:
                st.dataframe(detail, hide_index=True, key=f"nan.episode.{i}")
    if len(episodes) > MAX_EXPANDERS:
        st.caption(f"{len(episodes) - MAX_EXPANDERS} more episodes: their steps are in the table above.")


def render() -> None:
    sel = current()
    st.header("NaN events")
    if not needs_runs(sel, "their non-finite gradient steps"):
        return
    ids = list(sel.picked)
    with st.spinner("Loading gradient metrics..."):
        h = data.histories(sel.uri, ids, GRAD_KEYS, live=sel.running).histories
        alerts = data.alert_events(sel.uri, tuple(ids), data.runs_version(sel.runs, ids))
    events = nan_events(h, data.get_store(sel.uri), ids, alerts)
    counts = events.groupby("run_id")["step"].agg(["count", "min"]) if len(events) else pd.DataFrame()
    summary = pd.DataFrame({
        "run": [sel.labels[r] for r in ids],
        "non-finite steps": [int(counts["count"].get(r, 0)) if len(counts) else 0 for r in ids],
        "first step": [str(int(counts["min"][r])) if len(counts) and r in counts.index else "-" for r in ids],
        "alerts (tag)": [int(sel.runs.set_index("run_id").at[r, "alerts"]) for r in ids],
    })
    overflows = [len(ov.steps) if (ov := scaler_overflows(h, r)) else 0 for r in ids]
    if any(overflows):  # fp16: an ordinary event, counted apart from the non-finite steps
        summary["scaler overflows"] = overflows
    st.dataframe(summary, hide_index=True, key="nan.summary")
    no_grad = [r for r in ids if h.get(r, keys.GRAD_NORM) is None and h.get(r, keys.GRAD_FINITE) is None]
    unchecked = unchecked_text({r: unchecked_steps(h, r) for r in ids}, sel.labels)
    if unchecked:
        st.warning(escape_md(unchecked), icon=":material/help:")
    if events.empty and (no_grad or unchecked):  # not an all-clear: some steps or runs were never checked
        st.info("No non-finite gradient among the steps that logged one; the runs and steps named here and "
                "below were not checked.", icon=":material/help:")
    elif events.empty:
        st.success("No non-finite gradient in the picked runs (grad/finite and the grad norm are finite "
                   "at every logged step).", icon=":material/check:")
    else:
        _episodes(sel, events, h, alerts)
    params = {r: c.params for r, c in data.configs(sel.uri, tuple(ids)).items()} if len(events) else {}
    over, loss = step_event_lines(h, ids, sel.labels, params)
    for line in loss:  # no NaN gradient, but the loss the run optimises is NaN: its own warning
        st.warning(escape_md(line), icon=":material/warning:")
    for line in over:
        st.info(escape_md(line), icon=":material/info:")
    other = nonfinite_table(h, ids)
    other = other[other["key"] != keys.GRAD_FINITE]
    if len(other):
        st.subheader("Non-finite values per metric")
        other.insert(0, "run", other.pop("run_id").map(sel.labels))
        st.dataframe(other.astype({"steps": str}), hide_index=True, key="nan.metrics")
    if no_grad:
        st.caption("No gradient metric (grad/norm, grad/finite or an alias) in: "
                   + ", ".join(escape_md(sel.labels[r]) for r in no_grad))
