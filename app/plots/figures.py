"""Plotly figures of runs overlaid per metric: pure builders shared by the dashboard and the reports.

    fig = metric_figure(keys.RATIO_MEAN, h.for_key(keys.RATIO_MEAN, ids), labels=labels,
                        reference_ids=[ref], divergences={cand: d}, options=ChartOptions(delta=True))

Each run is one line, decimated by `rldiag.app.plots.decimate` (every bucket's min and max, so no spike is lost),
drawn in the run's own colour (`run_colors`: from the run, not its place in the picked list); the
reference runs wider and on top. Every NaN, +inf and -inf point is a marker of its own on a hidden
[0, 1] axis: NaN as an x at the top edge, +inf a triangle at the top, -inf a triangle at the bottom,
so a non-finite step shows whatever the line's scale; each run's markers sit a little further from
the edge than the previous run's, so two runs NaN at the same steps both show, and each marker kind
has its legend entry under its run. On a log scale the values <= 0 break the line and are open
circles at the bottom, counted in the title. A candidate's divergence onset is a dashed vertical
line (candidates leaving at one step split its height) and a diamond on the candidate's curve. Run
names are escaped: plotly shows them as text in legends and hover labels, never as HTML.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go

from rldiag.app.analysis.divergence import Divergence, zero_rate_text
from rldiag.app.data.align import align_by_step
from rldiag.app.data.trace import Trace
from rldiag.app.plots.decimate import DEFAULT_POINTS, decimate
from rldiag.app.plots.plotly_compat import figure_from_dicts

# Okabe-Ito, then Tableau: distinguishable for colour-blind readers; the reference always takes black.
REFERENCE_COLOR = "#111111"
PALETTE = ("#E69F00", "#56B4E9", "#009E73", "#D55E00", "#CC79A7", "#0072B2", "#F0E442",
           "#8C564B", "#7F7F7F", "#BCBD22", "#17BECF", "#9467BD")
REFERENCE_GREYS = ("#111111", "#555555", "#888888", "#AAAAAA")

NAN_SUFFIX = " NaN"
POSINF_SUFFIX = " +inf"
NEGINF_SUFFIX = " -inf"
NONPOS_SUFFIX = " ≤ 0"  # log scale: finite values it cannot draw
DIVERGES_PREFIX = "diverges: "
MARKER_OFFSET = 0.04  # of the panel's height, between the markers of two runs


@dataclass(frozen=True)
class ChartOptions:
    """How every metric chart of a view is drawn."""

    delta: bool = False  # plot each run minus the reference (mean of the references) at the same step
    smoothing: float = 0.0  # exponential moving average weight in [0, 1), as TensorBoard's slider; 0: raw
    log_y: bool = False  # logarithmic y axis (values <= 0: a line break and an open circle at the bottom)
    first: int | None = None  # first step shown (None: the start)
    last: int | None = None  # last step shown (None: the end)
    n_points: int = DEFAULT_POINTS  # line points per run after decimation
    height: int = 300  # pixels

    def __post_init__(self):
        if not 0.0 <= self.smoothing < 1.0:
            raise ValueError(f"smoothing={self.smoothing}: use a weight in [0, 1), e.g. 0.6 (0 turns it off)")
        if self.first is not None and self.last is not None and self.first > self.last:
            raise ValueError(f"step range {self.first}..{self.last} is empty: the first step must be <= the last")


def run_order(runs) -> list[str]:
    """Run ids oldest first (start time, then id): the order `run_colors` reads a run's colour from.
    `runs`: a DataFrame with `run_id` and `start_time` columns, every run of the experiment(s) (the
    dashboard's run list, the report's search), so that a run keeps its colour whatever is picked."""
    if runs is None or not len(runs):
        return []
    import pandas as pd

    # datetimes (find_runs) or epoch numbers (a raw search): only their order matters
    t = runs["start_time"]
    t = t if pd.api.types.is_datetime64_any_dtype(t) else pd.to_datetime(t, unit="ms", utc=True, errors="coerce")
    df = pd.DataFrame({"run_id": runs["run_id"].to_numpy(), "t": t.to_numpy()})
    return df.sort_values(["t", "run_id"], kind="stable", na_position="first")["run_id"].tolist()


def _hash_slot(run_id: str) -> int:
    """A palette slot from the run id alone (a stable hash, the same in every process)."""
    return int(hashlib.sha1(run_id.encode()).hexdigest()[:8], 16)


def run_colors(run_ids: Sequence[str], reference_ids: Sequence[str] = (), *,
               order: Sequence[str] | None = None) -> dict[str, str]:
    """A colour per run that follows the run, not its place in the picked list: a candidate takes the
    palette colour of its place in `order` (every run of its experiment, oldest first: `run_order`);
    references take black and greys in that order. A run not in `order` (or no `order`): a stable hash
    of its id. The dashboard and the report pass the same order, so a run has one colour in both."""
    refs = set(reference_ids)
    place = {r: i for i, r in enumerate(order or ())}

    def slot(r: str) -> int:
        return place[r] if r in place else _hash_slot(r)

    ref_ids = sorted((r for r in run_ids if r in refs), key=lambda r: (r not in place, place.get(r, 0), r))
    colors = {r: REFERENCE_GREYS[i % len(REFERENCE_GREYS)] for i, r in enumerate(ref_ids)}
    colors.update({r: PALETTE[slot(r) % len(PALETTE)] for r in run_ids if r not in refs})
    return colors


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
    """Markers on the hidden [0, 1] axis, listed in the legend under their run (`legendgroup`)."""
    return dict(type="scatter", x=steps, y=np.full(len(steps), y, np.float32), mode="markers", name=name,
                legendgroup=group, showlegend=True, yaxis="y2",
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


@functools.cache
def _template() -> dict:
    """plotly_white as the JSON plotly.js reads (what `template="plotly_white"` expands to)."""
    import plotly.io as pio

    return pio.templates["plotly_white"].to_plotly_json()


def metric_figure(
    key: str,
    traces: Mapping[str, Trace],
    *,
    labels: Mapping[str, str] | None = None,
    reference_ids: Sequence[str] = (),
    colors: Mapping[str, str] | None = None,
    divergences: Mapping[str, Divergence] | None = None,
    options: ChartOptions = ChartOptions(),
) -> go.Figure:
    """One metric, every run in `traces` ({run_id: trace}) overlaid; see the module docstring.

    `labels` maps run ids to legend names (default: the id); `divergences` maps candidate run ids to
    their `Divergence` for this metric (onset markers)."""
    labels = dict(labels or {})
    colors = dict(colors or run_colors(list(traces), reference_ids))
    shown = _delta_traces(traces, reference_ids) if options.delta else dict(traces)
    refs = set(reference_ids)
    data: list[dict] = []
    shapes: list[dict] = []
    order = [r for r in shown if r not in refs] + [r for r in shown if r in refs]  # references drawn last, on top
    marked = 0  # runs with markers so far: each next one sits a step further from the edge
    dropped_total = 0
    for run in order:
        t = shown[run].between(options.first, options.last)
        name = _text(labels.get(run, run))
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
        data.append(dict(
            type="scatter", x=x, y=_compact(y), mode="lines", name=name, legendgroup=run,
            line=dict(color=color, width=3.0 if is_ref else 1.6),
            opacity=1.0 if is_ref else 0.9,
            hovertemplate=f"%{{y:.4g}} at step %{{x}}<extra>{name}</extra>",
        ))
        if len(nf.nan) or len(nf.posinf) or len(nf.neginf) or dropped.any():
            # Two runs NaN at the same steps: offset each run's markers from the edge, so both show.
            top, bottom = 1.0 - MARKER_OFFSET * marked, MARKER_OFFSET * marked
            marked += 1
            if len(nf.nan):
                data.append(_marker(name + NAN_SUFFIX, nf.nan, top, "x", color, run))
            if len(nf.posinf):
                data.append(_marker(name + POSINF_SUFFIX, nf.posinf, top, "triangle-up", color, run))
            if len(nf.neginf):
                data.append(_marker(name + NEGINF_SUFFIX, nf.neginf, bottom, "triangle-down", color, run))
            if dropped.any():
                dropped_total += int(dropped.sum())
                data.append(_marker(name + NONPOS_SUFFIX, _thin(t.steps[dropped], options.n_points), bottom,
                                    "circle-open", color, run, size=7))
    onsets = {}
    for run, div in (divergences or {}).items():
        if run not in shown or not div.diverged:
            continue
        onset = div.onset_step
        if (options.first is not None and onset < options.first) or (options.last is not None and onset > options.last):
            continue
        onsets.setdefault(onset, []).append((run, div))
    for onset, at_step in onsets.items():
        for j, (run, div) in enumerate(at_step):
            t = shown[run]
            i = int(np.searchsorted(t.steps, onset))
            y = float(t.values[min(i, len(t) - 1)]) if len(t) else float("nan")
            color = colors.get(run, PALETTE[0])
            name = _text(DIVERGES_PREFIX + labels.get(run, run))
            # Candidates leaving at one step share the height (one segment each), so no colour mixes.
            n = len(at_step)
            shapes.append(dict(type="line", x0=onset, x1=onset, xref="x", y0=j / n, y1=(j + 1) / n,
                               yref="y domain", line=dict(color=color, dash="dash", width=1.5)))
            data.append(dict(
                type="scatter", x=[onset], y=[y if np.isfinite(y) else None], mode="markers", name=name,
                legendgroup=run, showlegend=True,
                marker=dict(symbol="diamond", size=11, color=color, line=dict(width=1, color="#000")),
                hovertemplate=(f"{name}<br>from step %{{x}} ({div.kind}, " + (
                    zero_rate_text(div.candidate_level, div.reference_level) if div.kind == "zero_rate"
                    else f"delta {div.delta:.3g} = {div.delta_sigma:.1f} sigma") + ")<extra></extra>"),
            ))
    title = f"{key} (minus reference)" if options.delta else key
    if dropped_total:
        title += f" · {dropped_total} points ≤ 0 not on the log scale (○ at the bottom)"
    xaxis = dict(title=dict(text="step"))
    if options.first is not None and options.last is not None:
        xaxis["range"] = [options.first, options.last]
    layout = dict(
        title=dict(text=_text(title), font=dict(size=14)),
        height=options.height, margin=dict(l=50, r=10, t=40, b=35),
        hovermode="x", showlegend=True,
        # At the right, where plotly.js grows the margin to fit it: below, it covered the "step" title.
        legend=dict(orientation="v", x=1.02, xanchor="left", y=1, yanchor="top", font=dict(size=10)),
        xaxis=xaxis, yaxis=dict(type="log" if options.log_y else "linear"),
        yaxis2=dict(overlaying="y", range=[0, 1], visible=False, fixedrange=True),
        template=_template(),
    )
    if shapes:
        layout["shapes"] = shapes
    # Built from plain dicts in one go without plotly's per-property validation (the same JSON, pinned
    # by tests/app/plots/test_figures.py against plotly's validated figure).
    return figure_from_dicts(data, layout)


def _compact(values: np.ndarray) -> np.ndarray:
    """float32 where it holds the values (a third less JSON), float64 for values beyond its range."""
    return values.astype(np.float32) if np.abs(values).max(initial=0.0) < 3e38 else values


def _text(text: str) -> str:
    """Run data as plain text for plotly, which reads names, titles and hover templates as a small HTML
    subset (and `%{...}` as template fields): escaped, `<img src=x onerror=...>` shows as those characters."""
    return (text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
            .replace("%{", "%&#123;"))


def trace_names(fig: go.Figure) -> list[str]:
    """The names of a figure's traces as a reader sees them (unescaped), in drawing order."""
    import html

    return [html.unescape(t.name.replace("%&#123;", "%{")) for t in fig.data]
