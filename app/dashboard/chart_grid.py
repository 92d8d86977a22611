"""The Compare page's chart grid (one plotly figure of panels, app/dashboard/grid_figure.py) drawn
by plotly.js's basic bundle in a Streamlit component (`st.components.v2`).

    chart_grid(plotly.io.to_json(grid_figure(figures)), key="compare.charts", config={"displaylogo": False})

The figure and config travel as one UTF-8 JSON payload of bytes (`payload`), parsed once in the browser.

Why not `st.plotly_chart`: that element loads Streamlit's full plotly.js (4.7 MB), whose evaluation
alone took 2.5-3 s of a 2-core machine's page load, against 0.5 s for the basic bundle (scatter, bar
and pie: every trace rldiag.app.plots.figures draws). The bundle, `static/plotly-basic.min.js`, is npm's
plotly.js-basic-dist-min 4.1.1 (MIT, its licence header kept), vendored as plotly.py vendors its own:
`npm pack plotly.js-basic-dist-min@VERSION` and copy `package/plotly-basic.min.js` to update it.

Where Streamlit cannot mount it (no `st.components.v2` before 1.51; `isolate_styles` on `component()`
came later) or the bundle is missing, the figure is an `st.plotly_chart`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import streamlit as st

STATIC = Path(__file__).resolve().parent / "static"
BUNDLE = STATIC / "plotly-basic.min.js"
COMPONENT = "rldiag.chart_grid"
CSS = ".rldiag-chart-grid { width: 100%; }"


def _register():
    """The component's mount function, or None where it cannot be had (see the module docstring)."""
    try:
        from streamlit.components.v2 import component
    except ImportError:
        return None
    if not BUNDLE.exists():
        return None
    js = BUNDLE.read_text(encoding="utf-8") + "\n" + (STATIC / "chart_grid.js").read_text(encoding="utf-8")
    try:
        # isolate_styles=False: plotly.js puts its styles (modebar, hover labels) in the document's
        # head, which a shadow root would not see.
        return component(COMPONENT, js=js, css=CSS, isolate_styles=False)
    except TypeError:  # an early st.components.v2 without isolate_styles here
        return None


# Registered once, at import, as Streamlit asks (a page script re-runs; this module does not).
_MOUNT = _register()


def chart_grid(figure: str, *, key: str, config: Mapping[str, object]) -> None:
    """Draw `figure` (plotly JSON, `plotly.io.to_json`) as wide as its column, with plotly's `config`."""
    if _MOUNT is not None:
        _MOUNT(data=payload(figure, config), key=key)
    else:
        st.plotly_chart(json.loads(figure), key=key, config=dict(config), theme=None)


def payload(figure: str, config: Mapping[str, object]) -> bytes:
    """What the component gets: `{"config": ..., "figure": ...}` as UTF-8 JSON bytes, the figure's JSON
    spliced in as it is. Bytes, not a dict: Streamlit sends a dict as JSON and dumps it twice a run (the
    message and the element's identity), escaping the figure's every quote, 2-4 MB at scale, and the
    browser then decodes that string in JavaScript and parses it twice; bytes are hashed once and reach
    the component as a Uint8Array (static/chart_grid.js parses it once)."""
    return b'{"config":' + json.dumps(dict(config)).encode() + b',"figure":' + figure.encode() + b"}"


def sent(proto) -> dict:
    """`{"config": ..., "figure": ...}` back from the element `chart_grid` sent (a BidiComponent proto)."""
    return json.loads(proto.bytes)
