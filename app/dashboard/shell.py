"""The dashboard's frame: page setup, the sidebar (store, experiment, reference and candidate runs) and
the routing to one render function per page (`st.navigation` over `st.Page` callables).
Read-only: nothing here writes to a run."""

from __future__ import annotations

from pathlib import Path

import streamlit as st

from rldiag.app.dashboard import compare, config_diff, config_table, html_table, nan_events, overview
from rldiag.app.dashboard.selection import escape_md, render_sidebar
from rldiag.app.errors import DataError

# Layout fixes over Streamlit's defaults: the run chips in the sidebar wrap instead of cutting a run's
# name; the main column starts closer to the top (6rem of padding pushed the first chart below the fold
# of a 1280x800 window); the static tables (config_table, html_table).
CSS = """
[data-testid="stSidebar"] [data-tag] { max-width: 100%; height: auto; }
[data-testid="stSidebar"] [data-tag] > span[title] { white-space: normal; overflow: visible; text-overflow: clip;
  max-width: none; overflow-wrap: anywhere; }
[data-testid="stMainBlockContainer"] { padding-top: 2.5rem; }
""" + config_table.CSS + html_table.CSS

PAGES = (  # (render function, title, url path, icon)
    (overview.render, "Runs", "runs", ":material/table_rows:"),
    (compare.render, "Compare", "compare", ":material/show_chart:"),
    (nan_events.render, "NaN events", "nan-events", ":material/error:"),
    (config_diff.render, "Config diff", "config-diff", ":material/difference:"),
)


# The tab's icon, served by this server: a Material icon name here makes the browser fetch it from a
# font host on the internet, and no page may ask anything of another machine.
FAVICON = Path(__file__).resolve().parent / "static" / "favicon.png"


def main(start: str | None = None) -> None:
    """Draw the sidebar and the page the URL names; `start` (a url path, e.g. "compare") is the page a
    bare URL opens (default: the runs overview)."""
    st.set_page_config(page_title="rldiag", page_icon=str(FAVICON), layout="wide")
    st.html(f"<style>{CSS}</style>")
    try:
        render_sidebar()
    except DataError as e:
        st.error(f"**Cannot read the tracking store.** {escape_md(str(e))}", icon=":material/cloud_off:")
        st.stop()
    first = start or PAGES[0][2]
    # Streamlit serves the default page at / and reserves its url path without serving it: /runs (a
    # bookmark, a link in the docs) would open "Page not found". The default page reserves another path,
    # and a hidden page under the real one draws the same page.
    pages = [st.Page(f, title=t, url_path=u, icon=i) if u != first else st.Page(f, title=t, url_path=f"{u}-start",
                                                                               icon=i, default=True)
             for f, t, u, i in PAGES]
    pages += [st.Page(f, title=t, url_path=u, visibility="hidden") for f, t, u, _ in PAGES if u == first]
    page = st.navigation(pages)
    try:
        page.run()
    except DataError as e:
        st.error(escape_md(str(e)), icon=":material/cloud_off:")

