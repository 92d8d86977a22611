"""Config diff: params and tags of the picked runs side by side, differing rows first, the
engine-parity knobs and the batch/accumulation settings leading (`rldiag.app.analysis.config_diff`)."""

from __future__ import annotations

import streamlit as st

from rldiag.app.dashboard import data
from rldiag.app.dashboard.selection import current, needs_runs


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
    table = data.config_rows(cfgs, {r: sel.labels[r] for r in ids}, show_identical=show_all)
    n_diff = int(table["differs"].sum())
    if n_diff == 0 and len(ids) > 1:
        st.success("The picked runs have the same params and tags.", icon=":material/check:")
    else:
        st.caption(f"{n_diff} params and tags differ. Engine-parity knobs first: an unpinned runtime "
                   "default (logprobs mode, prefix caching, async scheduling, dtypes) is a silent difference.")
    if len(table):
        st.dataframe(table, hide_index=True, key="config.table")
