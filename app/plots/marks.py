"""What a metric chart draws besides the runs' lines: a departure's onset, alert and span, the band the
detector tested a candidate against, and the legend's one key to them (`rldiag.app.plots.figures`).
Plain plotly dicts; run data escaped (`plain`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from rldiag.app.analysis.divergence import zero_rate_text
from rldiag.app.plots.colors import PALETTE

if TYPE_CHECKING:
    from rldiag.app.analysis.divergence import Band, Departure, Divergence
    from rldiag.app.data.trace import Trace
    from rldiag.app.plots.options import ChartOptions

DIVERGES_PREFIX = "diverges: "
SPAN_HEIGHT = 0.03  # the onset-to-alert bar, a fraction of the plot area's height


def band_traces(bands: Mapping[str, Band], shown: Mapping[str, Trace], colors: Mapping[str, str],
                 labels: Mapping[str, str], options: ChartOptions) -> list[dict]:
    """Per candidate's band: one filled shape (its upper edge forward, its lower edge back) and the
    candidate's trailing median the band is tested against, dotted; each thinned to about `n_points / 2`
    steps in the step range, where that median exists (the window 60% full): trailing medians of a window
    move little from one step to the next (9 candidates x 8 metrics drew 130k of the Compare page's 178k
    points: half as many took a tenth off the page's CPU in the browser). One shape, not an upper edge and
    a lower edge filled up to it: plotly.js pays per trace (its defaults, a crawl of its array attributes, a
    path), and the band was two of the three traces a diverged candidate added to a panel."""
    out: list[dict] = []
    for run, band in bands.items():
        if run not in shown or not len(band.steps):
            continue
        # before the window is 60% full there is no test: no band drawn (and a shape needs both edges)
        keep = np.isfinite(band.candidate) & np.isfinite(band.upper) & np.isfinite(band.lower)
        if options.first is not None:
            keep &= band.steps >= options.first
        if options.last is not None:
            keep &= band.steps <= options.last
        at = np.flatnonzero(keep)
        if not len(at):
            continue
        at = at[np.unique(np.linspace(0, len(at) - 1, min(len(at), max(2, options.n_points // 2))).round().astype(np.int64))]
        x, color = band.steps[at], colors.get(run, PALETTE[0])
        rgb = tuple(int(color.lstrip("#")[i:i + 2], 16) for i in (0, 2, 4))
        name = plain(f"{labels.get(run, run)} band ({band.window}-step median)")
        common = dict(type="scatter", mode="lines", legendgroup=run, showlegend=False)
        edges = np.concatenate([band.upper[at], band.lower[at][::-1]])
        out.append(dict(common, x=np.concatenate([x, x[::-1]]), y=compact(edges), name=name, line=dict(width=0),
                        hoverinfo="skip", fill="toself", fillcolor=f"rgba({rgb[0]},{rgb[1]},{rgb[2]},0.22)"))
        median = plain(f"{labels.get(run, run)} {band.window}-step median")
        out.append(dict(common, x=x, y=compact(band.candidate[at]), name=median,
                        line=dict(color=color, width=1.5, dash="dot"),
                        hovertemplate=f"%{{y:.4g}} at step %{{x}}<extra>{median}</extra>"))
    return out


def departure_marks(shown: Mapping[str, Trace], divergences: Mapping[str, Divergence], colors: Mapping[str, str],
                     labels: Mapping[str, str], options: ChartOptions) -> tuple[list[dict], list[dict]]:
    """Each diverged candidate's lead departure (`Divergence.lead`: the one its headline, verdict and tested
    band name; a burst that ended never ahead of a lasting shift): a dashed vertical line at its onset
    (candidates starting at one step split its height), a bar of its colour along the foot of the plot from the onset to the
    alert, and a diamond on its curve at the alert (diamonds at one step nest, the first the largest, so
    none hides another), hover text worded by `verdicts.when_text`. Traces and shapes; parts outside the
    step range left out."""
    from rldiag.app.analysis.verdicts import departure_size, when_text

    def shown_at(step: int) -> bool:
        return not ((options.first is not None and step < options.first)
                    or (options.last is not None and step > options.last))

    marks: list[tuple[str, Departure, int, int]] = []
    for run, div in divergences.items():
        if run not in shown or not div.diverged or (lead := div.lead) is None:
            continue
        onset = int(lead.onset_step)
        alert = lead.alert_step
        alert = onset if alert is None or not np.isfinite(alert) or alert < onset else int(alert)
        if shown_at(onset) or shown_at(alert) or (options.first is not None and onset < options.first <= alert):
            marks.append((run, lead, onset, alert))
    data: list[dict] = []
    shapes: list[dict] = []
    by_onset: dict[int, list[str]] = {}
    by_alert: dict[int, list[str]] = {}
    for run, _div, onset, alert in marks:
        by_onset.setdefault(onset, []).append(run)
        by_alert.setdefault(alert, []).append(run)
    for run, div, onset, alert in marks:
        color = colors.get(run, PALETTE[0])
        j, n = by_onset[onset].index(run), len(by_onset[onset])  # one segment each: no colour mixes
        if shown_at(onset):
            shapes.append(dict(type="line", x0=onset, x1=onset, xref="x", y0=j / n, y1=(j + 1) / n,
                               yref="y domain", line=dict(color=color, dash="dash", width=1.5)))
        if alert > onset:  # from the onset to the alert: the steps the evidence took to build up
            x0 = onset if options.first is None else max(onset, options.first)
            x1 = alert if options.last is None else min(alert, options.last)
            # a bar along the foot of its segment (SPAN_HEIGHT of the plot), apart from a band's fill
            shapes.append(dict(type="rect", x0=x0, x1=x1, xref="x", y0=j / n, y1=j / n + SPAN_HEIGHT, yref="y domain",
                               fillcolor=color, opacity=0.5, line=dict(width=0), layer="below"))
        if not shown_at(alert):
            continue
        t = shown[run]
        i = int(np.searchsorted(t.steps, alert))
        y = float(t.values[min(i, len(t) - 1)]) if len(t) else float("nan")
        size = departure_size(div.kind, div.delta, div.delta_sigma, div.candidate, div.reference)
        if div.kind == "zero_rate":
            size = zero_rate_text(div.candidate, div.reference)
        name = plain(DIVERGES_PREFIX + labels.get(run, run))
        k, m = by_alert[alert].index(run), len(by_alert[alert])
        data.append(dict(
            type="scatter", x=[alert], y=[y if np.isfinite(y) else None], mode="markers", name=name,
            legendgroup=run, showlegend=False,
            # at one step, diamonds nest (the first the largest, drawn first), so every colour shows
            marker=dict(symbol="diamond", size=11 + 6 * (m - 1 - k), color=color, line=dict(width=1, color="#000")),
            hovertemplate=plain(f"{DIVERGES_PREFIX}{labels.get(run, run)}: {when_text(onset, alert)}"
                                ) + "<br>" + plain(f"{div.kind}, {size}") + "<extra></extra>",
        ))
    return data, shapes


MARKER_KEY = {"NaN": "× NaN", "+inf": "▲ +inf", "-inf": "▼ -inf", "≤0": "○ ≤ 0", "alert": "◆ alert",
              "onset": "╎ onset", "band": "▒ band tested, ┈ its trailing median"}  # the legend's key: one short entry per marker kind drawn


def marker_key(kinds: Sequence[str]) -> str:
    """The legend's one key to the markers drawn ("× NaN ▲ +inf ◆ alert ╎ onset"), in MARKER_KEY's order;
    "" for none. Each marker sits under its run's legend entry, in the run's colour."""
    return "  ".join(MARKER_KEY[k] for k in MARKER_KEY if k in kinds)


def key_title(key: str) -> dict:
    """The legend's title holding the marker key (a row of its own above the runs), or nothing."""
    return {"title": dict(text=plain(key), font=dict(size=10, color="#666"), side="top")} if key else {}


def compact(values: np.ndarray) -> np.ndarray:
    """float32 where it holds the values (a third less JSON), float64 for values beyond its range."""
    return values.astype(np.float32) if np.abs(values).max(initial=0.0) < 3e38 else values


def plain(text: str) -> str:
    """Run data as plain text for plotly, which reads names, titles and hover templates as a small HTML
    subset (and `%{...}` as template fields): escaped, `<img src=x onerror=...>` shows as those characters."""
    return (text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
            .replace("%{", "%&#123;"))
