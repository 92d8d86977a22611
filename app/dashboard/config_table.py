"""The Config diff page's table as HTML: fits 10+ runs in the main column, the differences first.

    html = config_html(rows, run_labels, reference_labels)   # rows: data.config_rows(...) (a `differs` column)

A data grid gives each run a column of fixed width and scrolls the rest off-screen, so with 9 runs at
1440 px the candidates that differ were out of sight. Here the table takes the column's width
(`table-layout: fixed`), the cells wrap, the runs that differ from the first reference on most rows
come first after the references, the cells that differ from it are marked, and the identical rows
(on request) follow, greyed. Every value is escaped.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

import pandas as pd

MAX_CHARS = 120  # a cell; a longer value shows its start and its length
CSS = """
.rldiag-config table { table-layout: fixed; width: 100%; border-collapse: collapse; font-size: 13px; }
.rldiag-config th, .rldiag-config td { border: 1px solid #ddd; padding: 3px 6px; vertical-align: top;
  overflow-wrap: anywhere; text-align: left; }
.rldiag-config th { background: #f5f5f5; } .rldiag-config th.name { width: 22%; }
.rldiag-config td.d { background: #fff1e0; font-weight: 600; } .rldiag-config tr.same td { color: #888; }
.rldiag-config .group { color: #888; font-size: 11px; }
"""


def _cell(v) -> str:
    text = "(missing)" if v is None or (isinstance(v, float) and pd.isna(v)) else str(v)
    if len(text) > MAX_CHARS:
        text = f"{text[:MAX_CHARS]}... ({len(text)} characters)"
    return html.escape(text)


def run_order(rows: pd.DataFrame, labels: Sequence[str], reference_labels: Sequence[str]) -> list[str]:
    """References first, then the runs differing from the first reference on most rows (ties: as picked)."""
    refs = [r for r in labels if r in set(reference_labels)]
    if not refs or rows.empty:
        return refs + [r for r in labels if r not in set(refs)]
    base = rows[refs[0]]
    n_diff = {r: int((rows[r].astype(str) != base.astype(str)).sum()) for r in labels if r not in set(refs)}
    return refs + sorted(n_diff, key=lambda r: -n_diff[r])


def config_html(rows: pd.DataFrame, labels: Sequence[str], reference_labels: Sequence[str]) -> str:
    """`rows` (group, kind, name, differs, one column per label) as one table; see the module docstring."""
    order = run_order(rows[rows["differs"]], labels, reference_labels)
    base = order[0] if order else None
    refs = set(reference_labels)
    head = '<th class="name">name</th>' + "".join(
        f"<th>{html.escape(r)}{' (reference)' if r in refs else ''}</th>" for r in order)
    body = []
    for row in rows.to_dict("records"):
        cells = []
        for r in order:
            d = row["differs"] and base is not None and r != base and str(row[r]) != str(row[base])
            cells.append(f'<td class="d">{_cell(row[r])}</td>' if d else f"<td>{_cell(row[r])}</td>")
        name = (f'<code>{html.escape(str(row["name"]))}</code><br><span class="group">'
                f'{html.escape(str(row["group"]))} &middot; {html.escape(str(row["kind"]))}</span>')
        body.append(f'<tr class="{"differs" if row["differs"] else "same"}"><td>{name}</td>{"".join(cells)}</tr>')
    return (f'<div class="rldiag-config"><table><thead><tr>{head}</tr></thead>'
            f'<tbody>{"".join(body)}</tbody></table></div>')
