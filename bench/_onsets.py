"""Onset error on the labelled sets (issue 43 item 3), shared by bench.divergence_quality and
bench.divergence_length.

Per changed candidate whose first alert came at or after the change: the error is the reported onset
minus the change's first step. The band is the detector's for onsets (`onsets.first_out`): the
narrowest of the level windows' bands (`compute_band` per window) where the window is full, around the
references' centre. "Before the first point out": the candidate's own point at the first departure's
onset is inside that band (level departures only: no band is drawn for variance or non-finite ones).

A drift (0.03 sd per step) has no sharp start: its first point out is where drift and noise together
first pass the band's edge, 20 to 80 steps after the drift's first step and often well before the drift
alone reaches the edge (with noise of sd 1 the edge is 2 to 3 sd). Neither step is one an onset could be
within 10 steps of, so a drift's error is reported beside the others (from its first step, and from where
the drift alone reaches the band's edge) and left out of the pooled figures and their goal.
"""

from __future__ import annotations

import numpy as np

from rldiag.app.analysis.divergence import compute_band


def _band(refs, cand, config):
    """(steps, centre, upper half-width, lower half-width, log) of the narrowest window band (widths at the
    last step, where every window that fills is full; as log ratios where the band is, as the detector's
    log comparison draws it, symmetric in logs and not in metric units)."""
    best = None
    for w in config.windows:
        band = compute_band(refs, cand, config, window=w)[0]
        if not len(band.steps):
            return None
        with np.errstate(all="ignore"):
            c, up, lo = band.center[-1], band.upper[-1], band.lower[-1]
            log = not np.isclose(up - c, c - lo, rtol=1e-6)  # a band symmetric in metric units: compared linearly
            widths = (float(np.log(up / c)), float(np.log(c / lo))) if log else (up - c, c - lo)
        if best is None or widths[0] < best[2]:
            best = (band.steps, band.center, widths[0], widths[1], log)
    return best


def _gap(v, c, log: bool):
    with np.errstate(all="ignore"):
        return np.log(v / c) if log else v - c


def drift_edge(band, cand, base_values: np.ndarray, at: int) -> int | None:
    """The first step from `at` on where the drift alone (changed minus unchanged) passes the edge of `band`
    (`_band`'s)."""
    if band is None:
        return None
    steps, _, up, down, log = band
    idx = np.searchsorted(cand.steps, steps)
    drift = _gap(cand.values[idx], base_values[idx], log)
    with np.errstate(invalid="ignore"):
        hit = np.flatnonzero(((drift >= up) | (-drift >= down)) & (steps >= at))
    return int(steps[hit[0]]) if len(hit) else None


def before_first_out(band, cand, d) -> bool | None:
    """Whether the candidate's point at a level onset is inside `band` (`_band`'s; None: not a level departure)."""
    if d.first is None or d.first.kind != "level" or band is None:
        return None
    steps, center, up, down, log = band
    i = np.flatnonzero(steps == d.onset_step)
    if not len(i):
        return None
    g = float(_gap(cand.values[np.searchsorted(cand.steps, d.onset_step)], center[i[0]], log))
    return bool(-down <= g <= up)


def score(refs, cand, at: int, d, config, kind: str, base_values: np.ndarray | None) -> dict:
    """One changed candidate's onset figures: error, from the drift's edge (a drift), before the first point out."""
    drift = kind == "drift" and base_values is not None
    level = d.first is not None and d.first.kind == "level"
    band = _band(refs, cand, config) if drift or level else None  # five compute_band calls: once per candidate
    edge = drift_edge(band, cand, base_values, at) if drift else None
    return {"error": int(d.onset_step - at), "from_edge": None if edge is None else int(d.onset_step - edge),
            "before_out": before_first_out(band, cand, d)}


def summarise(scored: list[dict]) -> dict:
    """Per kind: median error, worst early (most negative), > 10 steps early, before the first point out."""
    e = [s["error"] for s in scored]
    edge = [s["from_edge"] for s in scored if s["from_edge"] is not None]
    return {"n": len(e), "median": float(np.median(e)) if e else None, "worst_early": min(e) if e else None,
            "over_10_early": sum(x < -10 for x in e),
            "before_first_out": sum(s["before_out"] is True for s in scored),
            **({"median_from_edge": float(np.median(edge)), "worst_from_edge": min(edge)} if edge else {})}


def cell(s: dict | None) -> str:
    """A table cell: 'med / worst early / >10 early / before out' (a drift: and from the band's edge)."""
    if not s or not s["n"]:
        return "-"
    out = f"{s['median']:g} / {s['worst_early']} / {s['over_10_early']} / {s['before_first_out']}"
    return out + (f" (from the edge: {s['median_from_edge']:g}, worst {s['worst_from_edge']})"
                  if "median_from_edge" in s else "")
