"""The dashboard's frame: page setup, the sidebar (store, experiment, reference and candidate runs) and
the routing to one render function per page (`st.navigation` over `st.Page` callables).
Read-only: nothing here writes to a run."""

from __future__ import annotations

import streamlit as st

from rldiag.app.dashboard import compare, config_diff, nan_events, overview
from rldiag.app.dashboard.selection import escape_md, render_sidebar
from rldiag.app.errors import DataError

PAGES = (  # (render function, title, url path, icon)
    (overview.render, "Runs", "runs", ":material/table_rows:"),
    (compare.render, "Compare", "compare", ":material/show_chart:"),
    (nan_events.render, "NaN events", "nan-events", ":material/error:"),
    (config_diff.render, "Config diff", "config-diff", ":material/difference:"),
)


def main(start: str | None = None) -> None:
    """Draw the sidebar and the page the URL names; `start` (a url path, e.g. "compare") is the page a
    bare URL opens (default: the runs overview)."""
    st.set_page_config(page_title="rldiag", page_icon=":material/monitoring:", layout="wide")
    try:
        render_sidebar()
    except DataError as e:
        st.error(f"**Cannot read the tracking store.** {escape_md(str(e))}", icon=":material/cloud_off:")
        st.stop()
    first = start or PAGES[0][2]
    pages = [st.Page(f, title=t, url_path=u, icon=i, default=u == first) for f, t, u, i in PAGES]
    page = st.navigation(pages)
    try:
        page.run()
    except DataError as e:
        st.error(escape_md(str(e)), icon=":material/cloud_off:")

