"""Reading what the dashboard drew, without a browser: plotly figures out of AppTest elements."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
from streamlit.testing.v1 import AppTest

APP = Path(__file__).resolve().parents[3] / "app" / "dashboard" / "streamlit_app.py"


def app(uri: str, monkeypatch, page: str | None = None) -> AppTest:
    """The dashboard against `uri`, run once (and switched to `page`, e.g. "compare.py")."""
    monkeypatch.setenv("RLDIAG_TRACKING_URI", uri)
    monkeypatch.delenv("RLDIAG_EXPERIMENT", raising=False)
    at = AppTest.from_file(str(APP), default_timeout=90).run()
    if page:
        at.switch_page(page).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def array(v) -> np.ndarray:
    """A plotly JSON array: a list, or plotly >= 6's {"dtype", "bdata"} (base64 of the raw buffer)."""
    if isinstance(v, dict) and "bdata" in v:
        return np.frombuffer(base64.b64decode(v["bdata"]), dtype=np.dtype(v["dtype"]))
    return np.asarray(v if v is not None else [], dtype=float)


def figures(at: AppTest) -> dict[str, list[dict]]:
    """`{chart title: [trace dict, ...]}` of every plotly chart on the page, x and y decoded."""
    out = {}
    for el in at.get("plotly_chart"):
        spec = json.loads(el.proto.spec)
        traces = []
        for t in spec["data"]:
            traces.append(dict(t, x=array(t.get("x")), y=array(t.get("y"))))
        out[spec["layout"]["title"]["text"]] = traces
    return out


def by_name(traces: list[dict]) -> dict[str, dict]:
    return {t["name"]: t for t in traces}


def unescape_md(text: str) -> str:
    return text.replace("\\", "").replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")
