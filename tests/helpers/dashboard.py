"""Reading what the dashboard drew, without a browser: plotly figures out of AppTest elements."""

from __future__ import annotations

import base64
import json

import numpy as np
import pandas as pd
from streamlit.testing.v1 import AppTest

from rldiag.app.dashboard.chart_grid import COMPONENT, sent


def _dashboard(start: str | None) -> None:
    from rldiag.app.dashboard.shell import main

    main(start)


def app(uri: str, monkeypatch, page: str | None = None) -> AppTest:
    """The dashboard against `uri`, run once on `page` (its url path, e.g. "compare"; default: the first).

    AppTest cannot switch to a callable page (`st.Page(render)`), so the page is opened as a URL
    naming it would: as the page the app starts on."""
    monkeypatch.setenv("RLDIAG_TRACKING_URI", uri)
    monkeypatch.delenv("RLDIAG_EXPERIMENT", raising=False)
    at = AppTest.from_function(_dashboard, kwargs={"start": page}, default_timeout=90).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def array(v) -> np.ndarray:
    """A plotly JSON array: a list, or plotly >= 6's {"dtype", "bdata"} (base64 of the raw buffer)."""
    if isinstance(v, dict) and "bdata" in v:
        return np.frombuffer(base64.b64decode(v["bdata"]), dtype=np.dtype(v["dtype"]))
    return np.asarray(v if v is not None else [], dtype=float)


def chart_specs(at: AppTest) -> list[dict]:
    """The plotly figures the page sends the browser, in order: the chart grid component's
    (rldiag.app.dashboard.chart_grid) and any `st.plotly_chart`'s."""
    specs = [sent(el.proto)["figure"] for el in at.get("bidi_component")
             if el.proto.component_name == COMPONENT]
    return specs + [json.loads(el.proto.spec) for el in at.get("plotly_chart")]


def panels(spec: dict) -> dict[str, list[dict]]:
    """`{title: [trace dict, ...]}` of a figure's panels as a reader sees them: a panel is titled by an
    annotation over its x axis ("x2 domain", rldiag.app.plots.grid_figure), a one-panel figure by its
    title. x and y decoded."""
    titles = {a["xref"].split(" ")[0]: a["text"] for a in spec["layout"].get("annotations", ())
              if a.get("xref", "").endswith(" domain")}
    if not titles:
        titles = {"x": spec["layout"]["title"]["text"]}
    out: dict[str, list[dict]] = {title: [] for title in titles.values()}
    for t in spec["data"]:
        out[titles[t.get("xaxis", "x")]].append(dict(t, x=array(t.get("x")), y=array(t.get("y"))))
    return out


def figures(at: AppTest) -> dict[str, list[dict]]:
    """`{panel title: [trace dict, ...]}` of every plotly chart on the page, in order, x and y decoded."""
    return {title: traces for spec in chart_specs(at) for title, traces in panels(spec).items()}


def by_name(traces: list[dict]) -> dict[str, dict]:
    return {t["name"]: t for t in traces}


def unescape_md(text: str) -> str:
    return text.replace("\\", "").replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")


def html_tables(elements) -> list[pd.DataFrame]:
    """The static tables (rldiag.app.dashboard.html_table) among `elements` (e.g. `at.markdown`), as
    DataFrames of the text they show (every cell a string)."""
    import html as html_mod
    import re

    out = []
    for el in elements:
        for table in re.findall(r'<div class="rldiag-table"><table>(.*?)</table></div>', el.value):
            heads = [html_mod.unescape(h) for h in re.findall(r"<th>(.*?)</th>", table)]
            rows = [[html_mod.unescape(c) for c in re.findall(r"<td[^>]*>(.*?)</td>", r)]
                    for r in re.findall(r"<tr>(.*?)</tr>", table.split("<tbody>", 1)[1])]
            out.append(pd.DataFrame(rows, columns=heads))
    return out
