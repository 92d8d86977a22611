"""The Config diff page's table as HTML: fits 10+ runs in the main column, the differences first.

    html = config_html(rows, run_labels, reference_labels)   # rows: data.config_rows(...) (a `differs` column)

A data grid gives each run a column of fixed width and scrolls the rest off-screen, so with 9 runs at
1440 px the candidates that differ were out of sight. Here the table takes the column's width, its
text wraps between words and after a `_ . / , = :` before a letter (never inside a word: "(referenc e)"), and scrolls
sideways in its block where even that does not fit. A candidate's cell is marked where it differs
from the value every reference shares; a row where the references disagree among themselves says
"varies across references" and marks no candidate (a seed or a run name differs in every run).
Without references, the first run is the base. The runs that differ on most rows come first after
the references; the identical rows (on request) follow, greyed. Every value is escaped.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence

import pandas as pd

from rldiag.app.analysis.config_diff import shared_values, value_key
from rldiag.app.dashboard.html_table import wrap_text as _wrap

MAX_CHARS = 120  # a cell; a longer value shows its start and its length
VARIES = "varies across references"
MISSING = value_key(None)
CSS = """
.rldiag-config { overflow-x: auto; }
.rldiag-config table { width: 100%; border-collapse: collapse; font-size: 13px; }
.rldiag-config th, .rldiag-config td { border: 1px solid #ddd; padding: 3px 6px; vertical-align: top;
  word-break: normal; overflow-wrap: normal; text-align: left; }
.rldiag-config th { background: #f5f5f5; } .rldiag-config th.name { width: 15%; }
.rldiag-config .role { white-space: nowrap; font-weight: normal; }
.rldiag-config td.d { background: #fff1e0; font-weight: 600; } .rldiag-config tr.same td { color: #888; }
.rldiag-config td.v { background: #eef3fb; } .rldiag-config .varies { color: #35608f; font-size: 11px; }
.rldiag-config .group { color: #888; font-size: 11px; }
"""
def _cell(v) -> str:
    text = "(missing)" if value_key(v) == MISSING else str(v)
    if len(text) > MAX_CHARS:
        text = f"{text[:MAX_CHARS]}... ({len(text)} characters)"
    return _wrap(text)


def _bases(labels: Sequence[str], reference_labels: Sequence[str]) -> list[str]:
    """The runs candidates are compared with: the references, or without any the first run."""
    return [r for r in labels if r in set(reference_labels)] or list(labels[:1])


def base_values(rows: pd.DataFrame, labels: Sequence[str], reference_labels: Sequence[str]) -> list[str | None]:
    """Per row, the value (as `value_key`) candidates are compared with: the one every reference shares
    (without references: the first run's); None where the references disagree."""
    return shared_values(rows, _bases(labels, reference_labels))


def run_order(rows: pd.DataFrame, labels: Sequence[str], reference_labels: Sequence[str]) -> list[str]:
    """The references (or the first run) first, then the runs differing from the references' common
    value on most rows (ties: as picked)."""
    bases = _bases(labels, reference_labels)
    others = [r for r in labels if r not in set(bases)]
    if rows.empty:
        return bases + others
    base = base_values(rows, labels, reference_labels)
    n_diff = {r: sum(b is not None and value_key(v) != b for v, b in zip(rows[r], base)) for r in others}
    return bases + sorted(others, key=lambda r: -n_diff[r])


def config_html(rows: pd.DataFrame, labels: Sequence[str], reference_labels: Sequence[str]) -> str:
    """`rows` (group, kind, name, differs, one column per label) as one table; see the module docstring."""
    order = run_order(rows[rows["differs"]], labels, reference_labels)
    refs = set(reference_labels)
    bases = set(_bases(labels, reference_labels))
    head = '<th class="name">name</th>' + "".join(
        f"<th>{_wrap(r)}{' <span class=role>(reference)</span>' if r in refs else ''}</th>" for r in order)
    body = [_row(row, order, bases, b) for row, b in zip(rows.to_dict("records"), base_values(rows, labels,
                                                                                              reference_labels))]
    return (f'<div class="rldiag-config"><table><thead><tr>{head}</tr></thead>'
            f'<tbody>{"".join(body)}</tbody></table></div>')


def _row(row: Mapping, order: Sequence[str], bases: set, base: str | None) -> str:
    """One param or tag: its name, then each run's value, marked where it differs from `base`."""
    varies = bool(row["differs"]) and base is None
    cells = []
    for r in order:
        if r in bases:
            cls = ' class="v"' if varies else ""  # the references disagree: theirs are the values that vary
        else:
            cls = ' class="d"' if row["differs"] and base is not None and value_key(row[r]) != base else ""
        cells.append(f"<td{cls}>{_cell(row[r])}</td>")
    name = (f'<code>{_wrap(str(row["name"]))}</code><br><span class="group">'
            f'{html.escape(str(row["group"]))} &middot; {html.escape(str(row["kind"]))}</span>')
    if varies:
        name += f'<br><span class="varies">{VARIES}</span>'
    return f'<tr class="{"differs" if row["differs"] else "same"}"><td>{name}</td>{"".join(cells)}</tr>'
