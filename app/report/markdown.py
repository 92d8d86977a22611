"""The report as GitHub-flavoured Markdown, short enough for a pull-request comment.

Run data (names, params, tags, keys) is escaped: Markdown's punctuation and `|` with a backslash,
`<`, `>` and `&` as HTML entities, newlines as spaces, so a value shows as typed and cannot end a
table cell, open a link or inject HTML. Long tables are cut at `MAX_ROWS`; the HTML report has them all.
"""

from __future__ import annotations

from rldiag.app.analysis.divergence import sigma_cell
from rldiag.app.analysis.nan_events import unchecked_text
from rldiag.app.analysis.step_events import step_event_lines
from rldiag.app.analysis.verdicts import rows_of
from rldiag.app.analysis.worst_tokens import worst_token_lines
from rldiag.app.data.steps import format_ranges
from rldiag.app.report.content import (
    ReportContent,
    fmt,
    fmt_stat,
    fmt_value,
    headline,
    metric_note,
    status_text,
    table_delta,
    verdict_table_shown,
)
from rldiag.app.report.table_rows import table_rows

MAX_ROWS = 60  # per table: a PR comment holds 65,536 characters
_ESCAPES = str.maketrans({
    "\\": "\\\\", "|": "\\|", "`": "\\`", "*": "\\*", "_": "\\_", "[": "\\[", "]": "\\]", "~": "\\~",
    "<": "&lt;", ">": "&gt;", "&": "&amp;", "\n": " ", "\r": " ",
})


def md(text: object) -> str:
    """Run data as literal Markdown text, safe inside a table cell."""
    return str(text).translate(_ESCAPES)


def _table(header: list[str], rows: list[list[str]], align: str = "") -> list[str]:
    """A GFM table; cells are already escaped. `align`: one of "l"/"r" per column (default left)."""
    seps = ["---:" if a == "r" else "---" for a in (align or "l" * len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(seps) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows[:MAX_ROWS]]
    if len(rows) > MAX_ROWS:
        lines.append(f"\n_{len(rows) - MAX_ROWS} more rows in the HTML report._")
    return lines


def _causes(c: ReportContent) -> list[str]:
    """Every candidate's ranked likely causes: what matched, which settings, the fix, the source."""
    found = [rc for rc in c.causes if rc.causes or rc.also_differs]
    if not found:
        return []
    out = ["### Likely causes", ""]
    for rc in found:
        out.append(f"**{md(c.labels[rc.run_id])}**" + ("" if rc.causes else ": no likely cause"))
        out.append("")
        for i, cause in enumerate(rc.causes, 1):
            out.append(f"{i}. **{md(cause.title)}**" + (f" ({md(cause.hint)})" if cause.hint else ""))
            out += [f"   - metrics: {md(t)}" for t in cause.signature]
            out += [f"   - settings: {md(t)}" for t in cause.settings]
            out += [f"   - fix: {md(cause.fix)}", f"   - source: {md(cause.source)}"]
        if rc.also_differs:
            out.append("- also differs, with no signature of its own in these metrics: "
                       + "; ".join(md(t) for t in rc.also_differs))
        out.append("")
    return out


def render_markdown(c: ReportContent) -> str:
    """The Markdown summary: runs, divergence, non-finite gradients and values, config differences."""
    labels = c.labels
    out = [f"## rldiag report: {md(c.title)}", ""]
    for role, ids in (("References", c.reference_ids), ("Candidates", c.candidate_ids)):
        out.append(f"**{role}:** " + ", ".join(f"{md(labels[r])} ({md(r[:8])})" for r in ids) + "  ")
    out += [f"Metrics: {', '.join(md(k) for k in c.keys) or 'none'}. Store: {md(c.store_uri)}; {md(c.generated_utc)}. "
            f"Detector options: {md(c.detector)}.",
            ""]

    rows = rows_of(c.summaries, c.causes, labels)  # the Compare page's table above its charts, the same rows
    if verdict_table_shown(rows):
        out += ["### Verdict", ""] + _table(["candidate", "verdict", "departs", "likely cause", "fix"],
                                            [[md(x) or "-" for x in r] for r in rows]) + [""]
    out += ["### Divergence from the references", ""]
    if c.reference_note:
        out += [f"*{md(c.reference_note)}*", ""]
    summaries = {s.run_id: s for s in c.summaries}
    causes = {rc.run_id: rc for rc in c.causes}
    for s in c.summaries:
        out.append("- " + md(headline(s, labels[s.run_id])))
        if s.run_id in causes and causes[s.run_id].line():
            out.append("  - " + md(causes[s.run_id].line()))
    div = c.divergence
    hits = table_rows(div[div["status"] == "diverged"].to_dict("records"), c.summaries)  # a row per departure
    if hits:
        out.append("")
        out += _table(["candidate", "metric", "onset step", "alert step", "kind", "end step", "delta",
                       "size (vs reference)", "delta (sigma)", "first non-finite step"],
                      [[md(labels[r["run_id"]]), md(r["key"]), fmt(r["onset_step"]), fmt(r["alert_step"]), md(r["kind"]),
                        fmt(r["end_step"]) if r["end_step"] is not None else "(to the end)",
                        fmt_stat(table_delta(r["kind"], r["delta"]), 3),
                        md(r["size"]) or "-", sigma_cell(r["delta_sigma"]), fmt(r["first_nonfinite_step"])]
                       for r in hits], "llrrlrrlrr")
    thin = div[div["status"] == "not_enough_steps"].to_dict("records")
    if thin:
        out.append("")
        out += _table(["candidate", "metric", "steps compared", "status", "note"],
                      [[md(labels[r["run_id"]]), md(r["key"]), fmt(r["steps_compared"]), md(status_text(r)),
                        md(metric_note(summaries[r["run_id"]], r["key"]) if r["run_id"] in summaries else "") or "-"]
                       for r in thin], "llrll")
    counts = div["status"].value_counts().to_dict() if len(div) else {}
    zero = sum(1 for r in thin if r["steps_compared"] == 0)
    said = [f"{n} {what}" for n, what in ((counts.get("diverged", 0), "leave the reference band"),
                                          (counts.get("within", 0), "stay inside it on enough steps"),
                                          (len(thin) - zero, "have not enough steps to tell"),
                                          (zero, "were not compared (0 steps)")) if n]
    if said:
        out += ["", f"Of {len(div)} (candidate, metric) comparisons: {', '.join(said)}.", ""]
    else:
        out.append("")

    out += _causes(c)
    out += ["### Non-finite gradients", ""]
    ev = c.nan_events
    unchecked = unchecked_text(c.unchecked, c.labels)
    if unchecked:
        out += [md(unchecked), ""]
    if ev.empty:
        out.append("No step with a non-finite gradient among the checked steps." if unchecked
                   else "No step with a non-finite gradient in any run.")
    else:
        rows = []
        for run in [r.run_id for r in c.runs]:
            e = ev[ev["run_id"] == run]
            if e.empty:
                continue
            first = e.iloc[0]
            params = sorted({p for ps in e["params"] for p in ps.split(", ") if p})
            rows.append([md(labels[run]), str(len(e)), md(format_ranges(e["step"])), fmt(first["grad_norm"]),
                         md(", ".join(params[:8]) + (f" (+{len(params) - 8} more)" if len(params) > 8 else "")),
                         md(first["positions"]) or "-"])
        out += _table(["run", "steps", "at steps", "grad norm at the first", "parameters named", "first positions"],
                      rows, "lrlrll")
    over, loss = step_event_lines(c.histories, [r.run_id for r in c.runs], labels, c.params)
    if over or loss:  # said apart from the NaN gradient steps, never among them
        out += ["", *(f"- {md(x)}" for x in loss + over)]
    out.append("")

    nf = c.nonfinite
    if not nf.empty:
        out += ["### Non-finite metric values", ""]
        out += _table(["run", "metric", "NaN", "+inf", "-inf", "at steps"],
                      [[md(labels[r["run_id"]]), md(r["key"]), str(r["nan"]), str(r["posinf"]), str(r["neginf"]),
                        md(format_ranges(r["steps"], limit=12))] for r in nf.to_dict("records")], "llrrrl")
        out.append("")

    worst = worst_token_lines(c.histories, labels)
    if worst:
        out += ["### Worst tokens (trainer vs engine)", "", *(f"- {md(w)}" for w in worst), ""]
    out += ["### Config differences", ""]
    diff = c.config_diff
    if diff.empty:
        out.append("Every param and tag is the same in all runs.")
    else:
        runs = [r.label for r in c.runs]
        out += _table(["kind", "name", *(md(r) for r in runs)],
                      [[md(kind), md(name), *(md(fmt_value(v)) for v in values)]  # by position: a run may be named "kind"
                       for _, kind, name, *values in diff.itertuples(index=False)])
    out += ["", "_Charts of every metric: the HTML report (rldiag report)._", ""]
    return "\n".join(out)
