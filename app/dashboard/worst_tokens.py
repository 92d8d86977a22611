"""The Compare page's "Worst tokens" section: per run, the step where trainer and engine disagree most."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from rldiag.app.analysis.worst_tokens import worst_of_run, worst_tokens
from rldiag.app.dashboard import data
from rldiag.app.dashboard.selection import Selection, escape_md
from rldiag.app.data.tokens import decoders_for
from rldiag.collectors import keys


def worst_token_rows(tokens, label: str, decode=None) -> list[dict]:
    """Table rows (one per step) for the expander; `decode` (token id -> text) where the tokenizer is at hand."""
    return [{"run": label, "step": w.step, "sample": w.sample, "position": w.position,
             "token id": w.token_id if w.token_id >= 0 else None,
             "token": decode(w.token_id) if decode is not None and w.token_id >= 0 else None,
             "trainer logprob": w.lp_trainer,
             "engine logprob": w.lp_engine, "|Δ logprob|": w.abs_diff} for w in tokens]


def render_section(sel: Selection, run_ids: list[str]) -> None:
    """Shown only when a picked run logged `mismatch/worst/*` (policy_metrics with lp_trainer_at_rollout)."""
    h = data.histories(sel.uri, run_ids, keys.WORST_TOKEN_KEYS).histories
    found = [(r, worst_tokens(h, r)) for r in run_ids]
    found = [(r, ws) for r, ws in found if ws]
    if not found:
        return
    st.subheader("Worst tokens: trainer vs engine")
    cfgs = data.configs(sel.uri, tuple(r for r, _ in found))
    decoders = decoders_for({r: c.params for r, c in cfgs.items()})
    lines = [f"- **{escape_md(sel.labels.get(r, r))}**: {escape_md(worst_of_run(ws).line(decoders.get(r)))}"
             for r, ws in found]
    st.markdown("\n".join(lines))
    with st.expander("Every step's worst token"):
        rows = [row for r, ws in found for row in worst_token_rows(ws, sel.labels.get(r, r), decoders.get(r))]
        st.dataframe(pd.DataFrame(rows), hide_index=True, key="compare.worst.table")
    st.caption("Per step, the sampled token with the largest |trainer logprob - engine logprob| at the rollout "
               "weights (mismatch/worst/*): the place to look first when the mismatch metric moves.")
