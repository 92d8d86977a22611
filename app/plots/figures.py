"""Plotly figures of runs overlaid per metric: pure builders shared by the dashboard and the reports.

    fig = metric_figure(keys.RATIO_MEAN, h.for_key(keys.RATIO_MEAN, ids), labels=labels,
                        reference_ids=[ref], divergences={cand: d}, options=ChartOptions(delta=True))

Each run is one line, decimated by `rldiag.app.plots.decimate` (every bucket's min and max, so no spike is lost),
drawn in the run's own colour (`run_colors`: from the run, not its place in the picked list); the
reference runs wider and on top. Every NaN, +inf and -inf point is a marker of its own in a thin
strip above the plot area, on an axis of its own (`yaxis2`), so the data axis scales to the data
alone and no marker reads as a value: one row per run that has such points (two runs NaN at the
same steps both show), NaN an x, +inf a triangle up, -inf a triangle down, in the run's colour;
the strip's label names the kinds. On a log scale the values <= 0 break the line and are open
circles in that strip, counted in the title. A candidate's first departure: a dashed vertical line
at its onset (candidates starting at one step split its height), a bar of its colour along the foot
of the plot from the onset to the alert, and a diamond on its curve at the alert (diamonds at one
step nest, the first the largest, so none hides another), its hover text "alerted at step A
(started about step O)" as `verdicts.when_text` words it everywhere. Given a candidate's `Band`
(`compute_band`, the detector's own test), a light fill of its colour with the trailing median it
tests dotted: the median leaves the fill where that test flags. The legend is horizontal above the plot, its rows
counted into the top margin: one entry per run (a click hides the run and its markers), and one
key, the legend's title, to the marker kinds drawn ("× NaN  ▲ +inf  ◆ alert  ╎ onset"). Run
names are escaped: plotly shows them as text in legends and hover labels, never as HTML.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import numpy as np
import plotly.graph_objects as go

from rldiag.app.analysis.divergence import Band, Divergence
from rldiag.app.data.align import align_by_step
from rldiag.app.data.trace import Trace
from rldiag.app.plots.colors import PALETTE, REFERENCE_COLOR, REFERENCE_GREYS, run_colors, run_order  # noqa: F401
from rldiag.app.plots.decimate import decimate
from rldiag.app.plots.marks import (  # noqa: F401  (DIVERGES_PREFIX, MARKER_KEY: re-exported)
    DIVERGES_PREFIX,
    MARKER_KEY,
    band_traces,
    compact,
    departure_marks,
    key_title,
    marker_key,
    plain,
)
from rldiag.app.plots.options import ChartOptions
from rldiag.app.plots.plotly_compat import figure_from_dicts

NAN_SUFFIX = " NaN"
POSINF_SUFFIX = " +inf"
NEGINF_SUFFIX = " -inf"
NONPOS_SUFFIX = " ≤ 0"  # log scale: finite values it cannot draw
STRIP_ROW_PX = 10  # the non-finite strip: one row of markers per run that has any
STRIP_GAP_PX = 8  # between the strip and the plot area below it
STRIP_MAX = 0.4  # of the plot area's height at most (rows then come closer)
LEGEND_ROW_PX = 20  # one row of a horizontal legend in 10 px text
LEGEND_WIDTH_PX = 500  # the width a chart's legend rows are estimated for (a report chart: 560 px and more)
TITLE_PX = 30  # above the legend: the chart's title
DASHES = ("solid", "dot", "dash", "dashdot")  # candidates sharing a colour (more than 12) differ in line style
KINDS = ("NaN", "inf", "≤0")  # the strip's label names those it holds, in this order (short: a 60 px margin)


def smooth(values: np.ndarray, weight: float) -> np.ndarray:
    """TensorBoard's debiased exponential moving average over the finite values (others stay as they
    are). pandas' `ewm(adjust=True)` is exactly that: sum(w^i x_(n-i)) / sum(w^i)."""
    if weight <= 0 or len(values) == 0:
        return values
    import pandas as pd

    out = values.astype(np.float64, copy=True)
    finite = np.isfinite(values)
    out[finite] = pd.Series(values[finite]).ewm(alpha=1 - weight, adjust=True).mean().to_numpy()
    return out


def _delta_traces(traces: Mapping[str, Trace], reference_ids: Sequence[str]) -> dict[str, Trace]:
    """Each run minus the mean of the references at the same step (steps where a reference is missing drop)."""
    refs = [r for r in reference_ids if r in traces]
    if not refs:
        return dict(traces)
    al = align_by_step(traces, how="outer")
    ref_cols = [al.labels.index(r) for r in refs]
    ref_ok = al.present[:, ref_cols].all(axis=1)
    with np.errstate(invalid="ignore"):
        centre = al.values[:, ref_cols].mean(axis=1)
    out = {}
    for j, run in enumerate(al.labels):
        keep = al.present[:, j] & ref_ok
        with np.errstate(invalid="ignore"):
            d = al.values[keep, j] - centre[keep]
        t = traces[run]
        out[run] = Trace(t.run_id, t.key, t.source_key, al.steps[keep], d, np.zeros(int(keep.sum()), np.int64))
    return out


def _marker(name: str, steps: np.ndarray, y: float, symbol: str, color: str, group: str, size: int = 9) -> dict:
    """Markers in the strip above the plot (axis y2, row `y`), under their run's legend entry (not one of
    their own: the legend's key names the kinds)."""
    return dict(type="scatter", x=steps, y=np.full(len(steps), y, np.float32), mode="markers", name=name,
                legendgroup=group, showlegend=False, yaxis="y2",
                marker=dict(symbol=symbol, size=size, color=color, line=dict(width=1, color=color)),
                hovertemplate=f"{name}<br>step %{{x}}<extra></extra>", cliponaxis=False)


def _gap_starts(dropped: np.ndarray) -> np.ndarray:
    """Indices where a block of consecutive True values starts: one line break per block."""
    return np.flatnonzero(dropped & ~np.concatenate([[False], dropped[:-1]]))


def _thin(steps: np.ndarray, n: int) -> np.ndarray:
    """At most about `n` of `steps`, evenly spread, the first and last kept (markers of dropped points)."""
    if len(steps) <= n:
        return steps
    return steps[np.unique(np.linspace(0, len(steps) - 1, n).round().astype(np.int64))]


def bands_shown_text(bands: Mapping[str, Band], divergences: Mapping[str, Divergence], shown: Mapping) -> str:
    """" · bands of the first 3 of 9 to alert" for the chart's title where it shades fewer candidates'
    bands than could have one (`comparison.BANDS_PER_CHART`), else ""."""
    from rldiag.app.analysis.comparison import BANDS_PER_CHART, banded_order

    could = [c for c in banded_order(divergences) if c in shown]
    drawn = [c for c in bands if c in shown]
    # fewer drawn than could be, and the limit reached (a departure no window's band holds has none to draw)
    limited = len(drawn) >= BANDS_PER_CHART and len(could) > len(drawn)
    return f" · bands of the first {len(drawn)} of {len(could)} to alert" if limited else ""


# every trace type rldiag's charts draw (the basic plotly.js bundle's: app/dashboard/chart_grid.py)
TRACE_TYPES = ("scatter", "bar", "pie")


@functools.cache
def _template() -> dict:
    """plotly_white as the JSON plotly.js reads (what `template="plotly_white"` expands to), with the trace
    defaults of the types rldiag draws only: its defaults for 20-odd other types were 7 KB of every
    figure's JSON, parsed and read by plotly.js on every draw."""
    import plotly.io as pio

    full = pio.templates["plotly_white"].to_plotly_json()
    return {"layout": full["layout"], "data": {t: full["data"][t] for t in TRACE_TYPES if t in full["data"]}}


def metric_figure(
    key: str,
    traces: Mapping[str, Trace],
    *,
    labels: Mapping[str, str] | None = None,
    reference_ids: Sequence[str] = (),
    colors: Mapping[str, str] | None = None,
    divergences: Mapping[str, Divergence] | None = None,
    bands: Mapping[str, Band] | None = None,
    options: ChartOptions = ChartOptions(),
) -> go.Figure:
    """One metric, every run in `traces` ({run_id: trace}) overlaid; see the module docstring.

    `labels` maps run ids to legend names (default: the id); `divergences` maps candidate run ids to
    their `Divergence` for this metric (onset markers); `bands` maps candidates to the `Band` the
    detector tested them against (`compute_band`, with the verdicts' own config): drawn as a light fill
    of the candidate's colour with its trailing median dotted, which leaves the fill where that test
    flags. Not drawn in delta mode (the band is around the detector's centre, not the references' mean)."""
    labels = dict(labels or {})
    colors = dict(colors or run_colors(list(traces), reference_ids))
    shown = _delta_traces(traces, reference_ids) if options.delta else dict(traces)
    refs = set(reference_ids)
    data: list[dict] = []
    shapes: list[dict] = []
    order = [r for r in shown if r not in refs] + [r for r in shown if r in refs]  # references drawn last, on top
    marked = 0  # runs with markers so far: each run has its own row of the strip, from the top
    kinds: dict[str, None] = {}  # the marker kinds drawn, for the strip's label
    key_kinds: dict[str, None] = {}  # every marker kind drawn, for the legend's key (MARKER_KEY)
    seen: dict[str, int] = {}  # candidates drawn so far in each colour
    dropped_total = 0
    for run in order:
        t = shown[run].between(options.first, options.last)
        name = plain(labels.get(run, run))
        color = colors.get(run, PALETTE[0])
        values = smooth(t.values, options.smoothing)
        finite = np.isfinite(values)
        drawn = finite & (values > 0) if options.log_y else finite
        d = decimate(t.steps[drawn], values[drawn], n_out=options.n_points)
        x, y = d.steps, d.values
        dropped = finite & ~drawn  # log scale: values <= 0 have no place on the axis
        if dropped.any():  # break the line where they were, instead of joining their neighbours
            starts = t.steps[_gap_starts(dropped)]
            x = np.concatenate([x, starts])
            y = np.concatenate([y, np.full(len(starts), np.nan)])
            o = np.argsort(x, kind="stable")
            x, y = x[o], y[o]
        if not len(x) and len(t):  # a run with no drawable point keeps its legend entry
            x, y = t.steps[:1], np.full(1, np.nan)
        nf = t.nonfinite()  # every non-finite step of the raw trace, however many, as markers
        is_ref = run in refs
        # more candidates than colours: a colour's second candidate dotted, its third dashed, ...
        dash = DASHES[seen.get(color, 0) % len(DASHES)] if not is_ref else "solid"
        seen[color] = seen.get(color, 0) + (not is_ref)
        data.append(dict(
            type="scatter", x=x, y=compact(y), mode="lines", name=name, legendgroup=run,
            line=dict(color=color, width=3.0 if is_ref else 1.6, **({"dash": dash} if dash != "solid" else {})),
            opacity=1.0 if is_ref else 0.9,
            hovertemplate=f"%{{y:.4g}} at step %{{x}}<extra>{name}</extra>",
        ))
        if len(nf.nan) or len(nf.posinf) or len(nf.neginf) or dropped.any():
            # Each run its own row of the strip: two runs NaN at the same steps both show.
            row = float(marked)
            marked += 1
            if len(nf.nan):
                kinds["NaN"] = key_kinds["NaN"] = None
                data.append(_marker(name + NAN_SUFFIX, nf.nan, row, "x", color, run))
            if len(nf.posinf):
                kinds["inf"] = key_kinds["+inf"] = None
                data.append(_marker(name + POSINF_SUFFIX, nf.posinf, row, "triangle-up", color, run))
            if len(nf.neginf):
                kinds["inf"] = key_kinds["-inf"] = None
                data.append(_marker(name + NEGINF_SUFFIX, nf.neginf, row, "triangle-down", color, run))
            if dropped.any():
                kinds["≤0"] = key_kinds["≤0"] = None
                dropped_total += int(dropped.sum())
                data.append(_marker(name + NONPOS_SUFFIX, _thin(t.steps[dropped], options.n_points), row,
                                    "circle-open", color, run, size=7))
    band_note = ""
    if bands and not options.delta:
        drawn_bands = band_traces(bands, shown, colors, labels, options)
        data[:0] = drawn_bands  # beneath every line
        if drawn_bands:
            key_kinds["band"] = None
            band_note = bands_shown_text(bands, divergences or {}, shown)
    marks, mark_shapes = departure_marks(shown, divergences or {}, colors, labels, options)
    data.extend(marks)
    shapes.extend(mark_shapes)
    if marks:
        key_kinds.update(dict.fromkeys(("alert", "onset")))
    title = f"{key} (minus reference)" if options.delta else key
    if dropped_total:
        title += f" · {dropped_total} points ≤ 0 not on the log scale (○ in the strip above)"
    title += band_note
    xaxis = dict(title=dict(text="step"))
    if options.first is not None and options.last is not None:
        xaxis["range"] = [options.first, options.last]
    plot_px = options.height - TITLE_PX - 35  # the plot area: the height less the title and x axis margins
    y_domain, strip = _strip_axes(marked, list(kinds), plot_px)
    if marked:  # a light band behind the strip, so its markers never read as data
        shapes.append(dict(type="rect", xref="x domain", x0=0, x1=1, yref="y2 domain", y0=0, y1=1, layer="below",
                           fillcolor="#f2f2f2", line=dict(width=0)))
    key_text = marker_key(list(key_kinds))
    legend_px = (legend_rows([d["name"] for d in data if d.get("showlegend", True)]) + bool(key_text)) * LEGEND_ROW_PX
    layout = dict(
        title=dict(text=plain(title), font=dict(size=14), x=0, xanchor="left", xref="paper",
                   y=1, yanchor="top", yref="container", pad=dict(t=8)),
        height=options.height + legend_px, margin=dict(l=60, r=10, t=TITLE_PX + legend_px, b=35),
        hovermode="x", showlegend=True,
        # Above the plot, left to right, its rows counted into the top margin: at the right it took 40% of
        # a report chart's width with a scrollbar of its own; below, it covered the "step" title.
        legend=dict(orientation="h", x=0, xanchor="left", y=1, yanchor="bottom", font=dict(size=10),
                    traceorder="normal", itemwidth=30, **key_title(key_text)),
        meta={"marker_kinds": list(key_kinds)},  # grid_figure merges the panels' kinds into one key
        xaxis=xaxis, yaxis=dict(type="log" if options.log_y else "linear", domain=y_domain),
        yaxis2=strip,
        template=_template(),
    )
    if shapes:
        layout["shapes"] = shapes
    # Built from plain dicts in one go without plotly's per-property validation (the same JSON, pinned
    # by tests/app/plots/test_figures.py against plotly's validated figure).
    return figure_from_dicts(data, layout)


def _strip_axes(rows: int, kinds: Sequence[str], plot_px: float) -> tuple[list[float], dict]:
    """The data axis' domain and the strip's axis (y2): a band at the top of the plot area, one row per
    run with non-finite points, first run on top, labelled by the kinds it holds. Outside the data axis,
    its markers never stretch the data's autoscale. No such run: the data axis takes the whole height
    and y2 is a hidden axis over it with nothing on it."""
    if not rows:
        return [0.0, 1.0], dict(overlaying="y", range=[0, 1], visible=False, fixedrange=True)
    band = min(STRIP_MAX, (rows * STRIP_ROW_PX + 4) / plot_px)
    gap = STRIP_GAP_PX / plot_px
    axis = dict(domain=[1.0 - band, 1.0], anchor="x", range=[rows - 0.5, -0.5], fixedrange=True, showgrid=False,
                zeroline=False, showline=False, tickmode="array", tickvals=[(rows - 1) / 2], ticks="",
                ticktext=["/".join(sorted(kinds, key=KINDS.index))], tickfont=dict(size=10, color="#666"))
    return [0.0, max(0.2, 1.0 - band - gap)], axis


def legend_rows(names: Sequence[str], width: float = LEGEND_WIDTH_PX) -> int:
    """Rows a horizontal legend of `names` (plotly text: escaped) takes in `width` pixels: one row where
    all fit, else plotly.js lines them up in columns as wide as the widest entry (its 40 px symbol and
    gap and about 6 px a character of 10 px text)."""
    import html
    import math

    widths = [40 + 6 * len(html.unescape(n)) for n in names]
    if sum(widths) <= width:
        return 1
    return math.ceil(len(widths) / max(1, int(width // max(widths))))


def trace_names(fig: go.Figure) -> list[str]:
    """The names of a figure's traces as a reader sees them (unescaped), in drawing order."""
    import html

    return [html.unescape(t.name.replace("%&#123;", "%{")) for t in fig.data]
