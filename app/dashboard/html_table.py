"""Static HTML tables for the dashboard's pages: the text wraps between words (never inside one:
"ste ps"), and a table wider than its column scrolls sideways in its block, so no cell is cut (a data
grid cuts long cells at its column width; `st.table` reads headers and cells as Markdown, so `lm_head`
turns italic and "# steps" a heading). Every value is escaped."""

from __future__ import annotations

import html
import re

import pandas as pd

CSS = """
.rldiag-table { overflow-x: auto; }
.rldiag-table table { width: 100%; border-collapse: collapse; font-size: 13px; margin-bottom: 6px; }
.rldiag-table th, .rldiag-table td { border: 1px solid #ddd; padding: 3px 6px; vertical-align: top;
  word-break: normal; overflow-wrap: normal; text-align: left; }
.rldiag-table th { background: #f5f5f5; white-space: nowrap; }
.rldiag-table td.num { text-align: right; white-space: nowrap; }
"""
# where a long name may wrap besides its spaces: after a separator followed by a letter
# ("model.<wbr>layers", "q_<wbr>proj", "raw_<wbr>logprobs"); never inside a number such as 1.5e-3
_BREAK_AFTER = re.compile(r"([_./,=:])(?=[A-Za-z])")


def wrap_text(text: str) -> str:
    """`text` escaped for HTML, with a line break opportunity (<wbr>) after each separator in its names."""
    return _BREAK_AFTER.sub(r"\1<wbr>", html.escape(text))


def html_table(df: pd.DataFrame, *, numeric: tuple[str, ...] = ()) -> str:
    """`df` (index not shown) as one escaped HTML table in a `rldiag-table` block, for `st.html` (or
    `st.markdown(..., unsafe_allow_html=True)`); columns in `numeric` align right and do not wrap."""
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in df.columns)
    rows = []
    for values in df.itertuples(index=False):
        cells = "".join(
            f'<td class="num">{html.escape(_text(v))}</td>' if c in numeric else f"<td>{wrap_text(_text(v))}</td>"
            for c, v in zip(df.columns, values))
        rows.append(f"<tr>{cells}</tr>")
    body = "".join(rows)
    return f'<div class="rldiag-table"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


def _text(v) -> str:
    return "-" if v is None or v is pd.NA or (isinstance(v, float) and pd.isna(v)) else str(v)
