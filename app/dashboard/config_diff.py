"""Config diff: params and tags of the picked runs side by side, differing rows first, the
engine-parity knobs and the batch/accumulation settings leading (`rldiag.app.analysis.config_diff`),
drawn as a table that fits 10+ runs (`rldiag.app.dashboard.config_table`)."""

from __future__ import annotations

import streamlit as st

from rldiag.app.dashboard import data
from rldiag.app.dashboard.config_table import config_html
from rldiag.app.dashboard.selection import current, needs_runs
from rldiag.app.report.content import ALERT_TAGS


def render() -> None:
    sel = current()
    st.header("Config diff")
    if not needs_runs(sel, "their params and tags side by side"):
        return
    ids = tuple(sel.picked)
    if len(ids) < 2:
        st.info("Pick at least two runs (a reference and a candidate) to diff their configs.")
    show_all = st.toggle("Show identical rows too", key="config.all")
    cfgs = data.configs(sel.uri, ids)
    labels = {r: sel.labels[r] for r in ids}
    table = data.config_rows(cfgs, labels, show_identical=show_all)
    table = table[~table["name"].isin(ALERT_TAGS)].reset_index(drop=True)  # alert state: the NaN events page
    n_diff, n_same = int(table["differs"].sum()), int((~table["differs"]).sum())
    if n_diff == 0 and len(ids) > 1:
        st.success("The picked runs have the same params and tags.", icon=":material/check:")
    else:
        st.caption(f"{n_diff} params and tags differ" + (f", then {n_same} identical rows (grey)" if show_all else
                   " (identical rows hidden)") + ". Engine-parity knobs first: an unpinned runtime default "
                   "(logprobs mode, prefix caching, async scheduling, dtypes) is a silent difference. A cell is "
                   "marked where it differs from the value every reference shares (a row whose references "
                   "disagree says so and marks none); the runs that differ most come first.")
    if len(table):
        st.markdown(config_html(table, list(labels.values()), [sel.labels[r] for r in sel.reference_ids]),
                    unsafe_allow_html=True)
