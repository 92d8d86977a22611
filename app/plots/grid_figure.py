"""One-metric figures (`rldiag.app.plots.figures.metric_figure(...).to_plotly_json()`) laid out as the panels of one
plotly figure, two a row: what the Compare page draws.

    fig = grid_figure([metric_figure(key, ...).to_plotly_json() for key in keys])

One figure instead of one chart per metric: plotly.js then builds one layout, one legend and one
modebar, and drawing 8 metrics took about a third less main-thread CPU in Chromium (0.8 s against
1.2 s for 8 charts of 10 runs, measured on a 2-core machine). Each panel keeps its figure's traces,
axes (type, range), vertical lines and its strip of NaN/inf markers (`yaxis2`: a band at the top of
the panel, or a hidden axis over it where the figure has no such marker). A panel's title is an
annotation above it whose `xref` names the panel's x axis ("x3 domain"): that is how a reader (the
tests, the benchmark) finds which traces a titled panel holds. One legend for every panel, above
them: a run's traces share its `legendgroup`, so a click on a run hides it everywhere, and each run is
listed once, from the first panel that draws it; its markers have no entries of their own (10 runs
with NaN, inf and onset markers made 19 entries), and one key, the legend's title, names every marker
kind any panel draws (`figures.marker_key`).

The margins are fixed (`autoexpand` off), with room for the legend's estimated rows: a legend or tick
labels pushing a margin make plotly.js lay out and draw the whole figure a second time (0.5 s of the
1.5 s the 8 panels took). The estimate is for a LEGEND_WIDTH_PX-wide legend; where the browser's
column is narrower and the legend needs more rows, static/chart_grid.js grows the top margin (and the
height with it) after drawing, so no legend row is ever cut off.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence

TITLE_PX = 30  # above each panel: its title
AXIS_PX = 55  # below each panel: tick labels and the x axis title
GAP = 0.07  # between two columns, as a fraction of the width
MARGIN = dict(l=60, r=20, b=10)  # pixels: l holds y tick labels such as "-0.00012", r the last x tick label
LEGEND_ROW_PX = 29  # one row of a horizontal legend with 10 px text (measured: 1 row 29 px, 3 rows 87)
LEGEND_WIDTH_PX = 800  # the width the legend's rows are estimated for: a laptop screen's main column


def grid_figure(figures: Sequence[Mapping], *, columns: int = 2, panel_height: int = 240) -> dict:
    """`figures` (plotly dicts of one panel each, with `yaxis2` as their only extra axis) as the panels
    of one figure, `columns` a row, in order; see the module docstring. Inputs are not modified."""
    if not figures:
        raise ValueError("grid_figure() needs at least one figure to lay out")
    if columns < 1:
        raise ValueError(f"columns={columns}: use 1 or more")
    n, first = len(figures), figures[0].get("layout", {})
    rows = math.ceil(n / columns)
    pitch = TITLE_PX + panel_height + AXIS_PX  # one row, in pixels
    height = rows * pitch
    width = (1 - GAP * (columns - 1)) / columns
    data: list[dict] = []
    layout: dict = {key: first[key] for key in ("template", "hovermode", "font") if key in first}
    layout.update(showlegend=True, annotations=[], shapes=[],
                  # traceorder "normal": entries left to right as _legend_rows estimates them ("grouped", the
                  # default with legend groups, stacks a run's line and markers in a column of their own)
                  legend=dict(first.get("legend", {}), orientation="h", x=0, xanchor="left", y=1, yanchor="bottom",
                              traceorder="normal"))
    listed: set = set()
    kinds: dict[str, None] = {}  # every panel's marker kinds, in order: the legend's one key
    for i, fig in enumerate(figures):
        row, col = divmod(i, columns)
        x0 = col * (width + GAP)
        top = 1 - (row * pitch + TITLE_PX) / height
        y_domain = [max(0.0, top - panel_height / height), top]
        suffix, marker_suffix = ("" if i == 0 else str(i + 1)), str(n + i + 1)
        refs = {"x": f"x{suffix}", "y": f"y{suffix}", "y2": f"y{marker_suffix}"}
        own = fig.get("layout", {})
        kinds.update(dict.fromkeys((own.get("meta") or {}).get("marker_kinds", ())))
        layout[f"xaxis{suffix}"] = dict(own.get("xaxis", {}), domain=[x0, x0 + width], anchor=refs["y"])
        layout[f"yaxis{suffix}"] = dict(own.get("yaxis", {}), anchor=refs["x"],
                                        domain=_within(own.get("yaxis", {}).get("domain"), y_domain))
        own_strip = own.get("yaxis2", {})
        strip = dict(own_strip, anchor=refs["x"], domain=_within(own_strip.get("domain"), y_domain))
        if "overlaying" in strip or not own_strip:  # a hidden axis over the data (no strip)
            strip["overlaying"] = refs["y"]
        layout[f"yaxis{marker_suffix}"] = strip
        for trace in fig.get("data", []):
            trace = dict(trace, xaxis=refs["x"], yaxis=refs.get(trace.get("yaxis", "y"), refs["y"]))
            if trace.get("showlegend", True) is not False:  # a run's line and its markers: each once
                entry = (trace.get("legendgroup", trace.get("name")), trace.get("name"))
                trace["showlegend"] = entry not in listed
                listed.add(entry)
            data.append(trace)
        for shape in own.get("shapes", ()):
            layout["shapes"].append(dict(shape, xref=_ref(shape.get("xref", "x"), refs),
                                         yref=_ref(shape.get("yref", "y"), refs)))
        title = own.get("title", {})
        layout["annotations"].append(dict(
            text=title.get("text", ""), font=title.get("font", {}), showarrow=False,
            xref=f"{refs['x']} domain", x=0, xanchor="left", yanchor="bottom", y=1,
            yref=f"{refs['y'] if 'overlaying' in strip else refs['y2']} domain",  # over the strip, if any
            yshift=6))
    from rldiag.app.plots.marks import key_title, marker_key

    key = marker_key(list(kinds))
    layout["legend"].pop("title", None)
    layout["legend"].update(key_title(key))
    legend_px = (_legend_rows([t["name"] for t in data if t.get("showlegend")]) + bool(key)) * LEGEND_ROW_PX + 4
    layout.update(height=height + legend_px + MARGIN["b"], margin=dict(MARGIN, t=legend_px, autoexpand=False))
    return {"data": data, "layout": layout}


def _legend_rows(names: Sequence[str]) -> int:
    """Rows a horizontal legend of `names` (plotly text: escaped) takes in LEGEND_WIDTH_PX, filled
    left to right: an entry is its 40 px symbol and gap and about 6 px a character (10 px font)."""
    rows, used = 1, 0.0
    for name in names:
        entry = 40 + 6 * len(html.unescape(name))
        if used and used + entry > LEGEND_WIDTH_PX:
            rows, used = rows + 1, 0.0
        used += entry
    return rows


def _within(domain, panel: Sequence[float]) -> list[float]:
    """A figure's axis `domain` (fractions of its plot area; None: all of it) as part of `panel`'s."""
    lo, hi = panel
    a, b = domain or (0.0, 1.0)
    return [lo + a * (hi - lo), lo + b * (hi - lo)]


def _ref(ref: str, refs: Mapping[str, str]) -> str:
    """A shape's axis reference ("x", "y domain", "paper") in panel terms."""
    axis, _, rest = ref.partition(" ")
    return f"{refs[axis]} {rest}".strip() if axis in refs else ref
