"""rldiag's dashboard: `rldiag app`, or `streamlit run app/dashboard/streamlit_app.py`.

Sets up the page, draws the sidebar (store, experiment, reference and candidate runs) and routes to
one page per view. Read-only: nothing here writes to a run.
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:  # `streamlit run` puts only this folder on the path
    sys.path.insert(1, _ROOT)

import streamlit as st  # noqa: E402

from app.dashboard.selection import escape_md, render_sidebar  # noqa: E402
from app.errors import DataError  # noqa: E402

HERE = Path(__file__).resolve().parent
PAGES = (  # (file, title, url path, icon)
    ("overview.py", "Runs", "runs", ":material/table_rows:"),
    ("compare.py", "Compare", "compare", ":material/show_chart:"),
    ("nan_events.py", "NaN events", "nan-events", ":material/error:"),
    ("config_diff.py", "Config diff", "config-diff", ":material/difference:"),
)


def main() -> None:
    st.set_page_config(page_title="rldiag", page_icon=":material/monitoring:", layout="wide")
    try:
        render_sidebar()
    except DataError as e:
        st.error(f"**Cannot read the tracking store.** {escape_md(str(e))}", icon=":material/cloud_off:")
        st.stop()
    pages = [st.Page(HERE / f, title=t, url_path=u, icon=i, default=n == 0) for n, (f, t, u, i) in enumerate(PAGES)]
    page = st.navigation(pages)
    try:
        page.run()
    except DataError as e:
        st.error(escape_md(str(e)), icon=":material/cloud_off:")


main()
