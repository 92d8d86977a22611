"""The departure tables' rows (the report's HTML and Markdown, the Compare page's every-departure table): a metric
that left the band more than once gets a row per departure, the one its verdict names first.

A `Divergence`'s own fields are its metric's first departure's; a burst that ended and then a lasting drift on
one metric read, in a table of those fields, as the burst alone while the verdict named the drift."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

from rldiag.app.analysis.divergence import DIVERGENCE_COLUMNS, CandidateSummary, Divergence


def departure_views(d: Divergence) -> list[Divergence]:
    """`d` once per departure, each with that departure's onset, alert, end, kind and size as its own fields:
    the one its verdict names (`Divergence.lead`: lasting, else largest) first, then the others by onset;
    `[d]` where it has at most one."""
    if len(d.departures) < 2:
        return [d]
    lead = d.lead
    return [replace(d, kind=x.kind, onset_step=x.onset_step, alert_step=x.alert_step, end_step=x.end_step,
                    delta=x.delta, delta_sigma=x.delta_sigma, candidate_level=x.candidate, reference_level=x.reference,
                    departures=(x,))
            for x in [lead, *(x for x in d.departures if x is not lead)]]


def table_rows(records: Iterable[Mapping], summaries: Iterable[CandidateSummary]) -> list[dict]:
    """`divergence_frame` records (one per candidate and metric) as a table shows them: a metric that left the
    band more than once as one row per departure (`departure_views`), the others as they are."""
    found = {(s.run_id, d.key): d for s in summaries for d in s.departures}
    out: list[dict] = []
    for r in records:
        d = found.get((r["run_id"], r["key"]))
        if d is None or len(d.departures) < 2:
            out.append(dict(r))
            continue
        out += [dict(r, **{f: getattr(v, f) for f in DIVERGENCE_COLUMNS[2:]}) for v in departure_views(d)]
    return out


__all__ = ["departure_views", "table_rows"]
