"""The sidebar: tracking store, experiment, comparison group, reference and candidate runs.

The choice lives in `st.session_state` under `sidebar.*` keys; `render_sidebar()` returns it as a
`Selection` that every page reads (`current()`). Defaults come from the rldiag tags: the group of the
newest tagged run, its `rldiag.role=reference` runs as references, its candidates as candidates.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pandas as pd
import streamlit as st

from rldiag.app.dashboard import LOCAL_HOSTS, RLDIAG_ALLOW_URI_INPUT, RLDIAG_EXPERIMENT, RLDIAG_TRACKING_URI, data
from rldiag.app.data.runs import run_labels
from rldiag.app.errors import NoRunsFound

ALL_RUNS = "(all runs)"
MAX_DEFAULT_CANDIDATES = 9  # untagged runs picked by default: the newest, so that a first load stays quick
MAX_TAGGED_CANDIDATES = 12  # runs tagged rldiag.role=candidate: the user named them, so a few more
MAX_DEFAULT_REFERENCES = 8  # a band of seeds; more add little and cost a load each
_STATE = "sidebar.selection"


@dataclass(frozen=True)
class Selection:
    uri: str
    experiment: str | None = None
    runs: pd.DataFrame | None = None  # rldiag.app.data.runs.find_runs of the experiment (every run, not only picked)
    reference_ids: tuple[str, ...] = ()
    candidate_ids: tuple[str, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)  # run id -> unique display name

    @property
    def picked(self) -> tuple[str, ...]:
        return self.reference_ids + self.candidate_ids

    def picked_runs(self) -> pd.DataFrame:
        """The overview rows of the picked runs, references first."""
        if self.runs is None:
            return pd.DataFrame()
        return self.runs.set_index("run_id").loc[list(self.picked)].reset_index()

    @property
    def running(self) -> bool:
        rows = self.picked_runs()
        return bool(len(rows)) and bool((rows["status"] == "RUNNING").any())


def escape_md(text: str) -> str:
    """Run data as literal text inside Streamlit markdown (no HTML, no formatting, no links)."""
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return re.sub(r"([\\`*_{}\[\]()#+\-.!|~$:])", r"\\\1", text)


def default_group(runs: pd.DataFrame) -> str:
    """The group of the newest run that has one (runs come newest first), else every run."""
    grouped = runs["group"].dropna()
    return grouped.iloc[0] if len(grouped) else ALL_RUNS


def default_picks(runs: pd.DataFrame) -> tuple[list[str], list[str]]:
    """References and candidates from `rldiag.role`; without roles the oldest run is the reference and
    the newest others are candidates. At most MAX_DEFAULT_REFERENCES and MAX_TAGGED_CANDIDATES (or
    MAX_DEFAULT_CANDIDATES untagged), the newest (`runs` is newest first): a group of 100 runs opens on
    a page that loads in seconds, and the others are a pick away (`capped_text` says how many)."""
    refs = runs.loc[runs["role"] == "reference", "run_id"].tolist()
    cands = runs.loc[runs["role"] == "candidate", "run_id"].tolist()
    if refs or cands:
        return refs[:MAX_DEFAULT_REFERENCES], cands[:MAX_TAGGED_CANDIDATES]
    ids = runs["run_id"].tolist()  # newest first
    return ids[-1:], ids[:-1][:MAX_DEFAULT_CANDIDATES]


def capped_text(runs: pd.DataFrame) -> str | None:
    """What `default_picks` left out of `runs`, as a line for the sidebar (None: nothing)."""
    refs, cands = default_picks(runs)
    tagged = runs["role"].isin(["reference", "candidate"]).any()
    n_refs = int((runs["role"] == "reference").sum()) if tagged else min(len(runs), 1)
    n_cands = int((runs["role"] == "candidate").sum()) if tagged else max(len(runs) - 1, 0)
    parts = [f"the newest {len(picked)} of {n} {what}" for picked, n, what in
             ((refs, n_refs, "references"), (cands, n_cands, "candidates")) if len(picked) < n]
    return f"Picked {' and '.join(parts)} of this group; add others in the lists above." if parts else None


def current() -> Selection:
    """The selection the sidebar made in this run."""
    return st.session_state[_STATE]


def _pick_experiment(uri: str) -> str | None:
    names, newest = data.experiments(uri)
    if not names:
        return None
    wanted = RLDIAG_EXPERIMENT.get()
    default = wanted if wanted in names else (newest or names[0])
    if st.session_state.get("sidebar.experiment") not in names:
        st.session_state["sidebar.experiment"] = default
    return st.sidebar.selectbox("Experiment", names, key="sidebar.experiment")


def _pick_runs(uri: str, experiment: str, runs: pd.DataFrame, labels: dict[str, str]) -> tuple[list[str], list[str]]:
    groups = [ALL_RUNS, *sorted(runs["group"].dropna().unique())]
    if st.session_state.get("sidebar.group") not in groups:
        st.session_state["sidebar.group"] = default_group(runs)
    group = st.sidebar.selectbox("Comparison group (rldiag.group)", groups, key="sidebar.group")
    shown = runs if group == ALL_RUNS else runs[runs["group"] == group]
    ids = shown["run_id"].tolist()
    sig = (uri, experiment, group)
    if st.session_state.get("sidebar._sig") != sig:  # a new experiment or group: its tag defaults
        refs, cands = default_picks(shown)
        st.session_state["sidebar.reference"], st.session_state["sidebar.candidates"] = refs, cands
        st.session_state["sidebar._sig"] = sig
    fmt = labels.get
    # A run that disappeared (deleted) or moved to the other list leaves the widget's value.
    st.session_state["sidebar.reference"] = [r for r in st.session_state["sidebar.reference"] if r in ids]
    refs = st.sidebar.multiselect("Reference run(s)", ids, format_func=fmt, key="sidebar.reference",
                                  help="Several references (seeds of one setup) form a noise band.")
    cand_ids = [r for r in ids if r not in refs]
    st.session_state["sidebar.candidates"] = [r for r in st.session_state["sidebar.candidates"] if r in cand_ids]
    cands = st.sidebar.multiselect("Candidate run(s)", cand_ids, format_func=fmt, key="sidebar.candidates")
    if (capped := capped_text(shown)) is not None:
        st.sidebar.caption(capped)
    return refs, cands


def uri_input_allowed() -> bool:
    """True only when `rldiag app --allow-uri-input` asked for the URI box and the server listens on
    localhost (checked here too: the environment alone never opens it on a network address)."""
    if not RLDIAG_ALLOW_URI_INPUT.get_bool():
        return False
    return str(st.get_option("server.address") or "") in LOCAL_HOSTS


def render_sidebar() -> Selection:
    """Draw the sidebar, store the `Selection` for the pages and return it. Raises DataError
    (StoreUnreachable and friends) for the entry script to show."""
    from rldiag.collectors.settings import default_tracking_uri
    from rldiag.collectors.uri import redact_uri

    st.sidebar.title("rldiag")
    uri = RLDIAG_TRACKING_URI.get() or default_tracking_uri()
    if uri_input_allowed():  # `rldiag app --allow-uri-input` on localhost only: a visitor never picks the store
        if "sidebar.uri" not in st.session_state:
            st.session_state["sidebar.uri"] = uri
        st.sidebar.text_input("Tracking URI", key="sidebar.uri", help="MLflow tracking store (read only)")
        uri = st.session_state["sidebar.uri"].strip()
    sel = Selection(uri)
    st.session_state[_STATE] = sel
    data.get_store(uri)  # StoreUnreachable: the entry shows it
    st.sidebar.caption(f"Store: `{redact_uri(uri)}`" if "`" not in uri else "Store: (see above)")
    experiment = _pick_experiment(uri)
    if experiment is None:
        return sel
    sel = Selection(uri, experiment)
    st.session_state[_STATE] = sel
    try:
        runs = data.runs(uri, experiment)
    except NoRunsFound:
        return sel
    labels = run_labels(dict(zip(runs["run_id"], runs["name"])))
    refs, cands = _pick_runs(uri, experiment, runs, labels)
    if st.sidebar.button("Reload from the store", key="sidebar.reload", help="Clear cached queries"):
        data.clear_caches()
        st.rerun()
    sel = Selection(uri, experiment, runs, tuple(refs), tuple(cands), labels)
    st.session_state[_STATE] = sel
    return sel


def needs_runs(sel: Selection, what: str) -> bool:
    """True when the page can draw; otherwise shows why not (no experiment, empty, nothing picked)."""
    if sel.experiment is None:
        st.info("The store has no experiments yet. Log a run into it first, e.g. `rldiag demo`.")
        return False
    if sel.runs is None:
        st.info(f"Experiment **{escape_md(sel.experiment)}** has no runs yet. Log runs into it "
                "(e.g. `rldiag demo --experiment NAME`) or pick another experiment in the sidebar.")
        return False
    if not sel.picked:
        st.info(f"No runs picked: choose reference and candidate runs in the sidebar to see {what}.")
        return False
    return True


def label_list(sel: Selection, run_ids: Sequence[str]) -> str:
    return ", ".join(escape_md(sel.labels.get(r, r)) for r in run_ids)
