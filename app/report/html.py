"""The report as one self-contained HTML file: plotly.js embedded once, each chart a div drawn from its
figure JSON, the tables as plain HTML. Opening it makes no network request (a Content-Security-Policy
forbids any), so it can be attached to an issue or mailed.

Run data is escaped: `html.escape` in the page, and in the figure JSON `<`, `>` and `&` are written
as \\u003c, \\u003e, \\u0026, so no value can close the <script> element that holds it or open a comment.
"""

from __future__ import annotations

import html
from functools import cache

from rldiag.app.analysis.config_diff import shared_values, value_key
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
from rldiag.app.report.nan_episodes import nan_episodes, origin_text
from rldiag.app.report.table_rows import table_rows

MAX_EVENT_ROWS = 2000  # per-step rows under the NaN episodes; the charts keep every non-finite step regardless
MAX_CONFIG_CHARS = 120  # a config cell; longer values are cut with their length said
PLOTLY_CONFIG = '{"responsive": true, "displaylogo": false}'
# Inline scripts and styles only: no fetch, no font, no image from anywhere (plotly exports to data: URLs).
CSP = ("default-src 'none'; script-src 'unsafe-inline' 'unsafe-eval'; style-src 'unsafe-inline'; "
       "img-src data: blob:; font-src data:")

_CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0 auto; padding: 16px 24px;
       max-width: 1600px; color: #222; }
h1 { font-size: 22px; margin: 4px 0; } h2 { font-size: 18px; margin: 28px 0 8px; border-bottom: 1px solid #ddd; }
.meta { color: #666; margin: 0 0 8px; } nav a { margin-right: 14px; }
table { border-collapse: collapse; margin: 6px 0 10px; } th, td { border: 1px solid #ddd; padding: 3px 8px;
  text-align: left; vertical-align: top; } th { background: #f5f5f5; } td.num { text-align: right; }
tr.hit td { background: #fff1e0; } tr.thin td { color: #666; background: #f6f6f6; } .swatch { display: inline-block; width: 12px; height: 12px;
  border-radius: 2px; margin-right: 6px; vertical-align: -1px; } code { font-size: 12px; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(560px, 1fr)); gap: 8px 16px; }
.chart { min-height: 300px; } .note { color: #666; font-style: italic; }
details { margin: 2px 0 6px; } summary { cursor: pointer; color: #335; }
th { white-space: nowrap; } th, td { word-break: normal; overflow-wrap: normal; }
.scroll { overflow-x: auto; max-width: 100%; } span.differs { background: #fff1e0; padding: 0 2px; } td.varies { color: #666; }
"""

_LOADER = """(function () {
  var config = %s;
  document.querySelectorAll('script[type="application/json"][data-chart]').forEach(function (s) {
    var fig = JSON.parse(s.textContent);
    Plotly.newPlot(document.getElementById(s.getAttribute("data-chart")), fig.data, fig.layout, config);
  });
})();""" % PLOTLY_CONFIG


def e(text: object) -> str:
    """Run data as HTML text (attributes too)."""
    return html.escape(str(text), quote=True)


@cache
def plotly_js() -> str:
    """plotly.min.js of the installed plotly package (about 4.8 MB), checked safe to inline."""
    from plotly.offline import get_plotlyjs

    js = get_plotlyjs()
    if "</script" in js.lower() or "<!--" in js:
        raise RuntimeError("this plotly.js bundle contains '</script' or '<!--' and cannot be inlined")
    return js


def script_json(text: str) -> str:
    """JSON made safe inside <script>: <, >, & only occur in JSON strings, where \\u escapes mean the same."""
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _figure_json(fig) -> str:
    import plotly.io as pio

    return script_json(pio.to_json(fig, validate=False))


def _table(header: list[str], rows: list[tuple[list[str], str]], num: set[int] = frozenset()) -> str:
    """Cells are already escaped; each row is (cells, css class)."""
    head = "".join(f"<th>{h}</th>" for h in header)
    body = "".join(
        f'<tr class="{cls}">' + "".join(f'<td class="num">{c}</td>' if i in num else f"<td>{c}</td>"
                                        for i, c in enumerate(cells)) + "</tr>"
        for cells, cls in rows)
    # a wide table scrolls sideways instead of breaking words mid-way ("(referenc e)")
    return f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


def _runs(c: ReportContent) -> str:
    rows = [([f'<span class="swatch" style="background:{e(r.color)}"></span>{e(r.label)}', e(r.role),
              f"<code>{e(r.run_id)}</code>", e(r.variant or "-"), e(r.seed or "-"), e(r.status)], "")
            for r in c.runs]
    return _table(["run", "role", "run id", "variant", "seed", "status"], rows)


def _verdict(c: ReportContent) -> str:
    """One line per candidate (`headline`): the first thing the page says; then, as the Compare page shows it
    above its charts, each candidate's verdict, departure, likely cause and fix."""
    labels = c.labels
    lines = "<ul>" + "".join(f"<li>{e(headline(s, labels[s.run_id]))}</li>" for s in c.summaries) + "</ul>"
    rows = rows_of(c.summaries, c.causes, labels)
    if not verdict_table_shown(rows):
        return lines
    return lines + _table(["candidate", "verdict", "departs", "likely cause", "fix"],
                          [([e(x) for x in r], "hit" if r.departs != "-" else "") for r in rows])


def _divergence(c: ReportContent) -> str:
    labels = c.labels
    summaries = {s.run_id: s for s in c.summaries}
    rows = []
    for r in table_rows(c.divergence.to_dict("records"), c.summaries):  # a row per departure
        s = summaries.get(r["run_id"])
        rows.append(([e(labels[r["run_id"]]), e(r["key"]), e(status_text(r)), _when(r), e(r["kind"] or "-"),
                      fmt(r["end_step"]) if r["onset_step"] is None or r["end_step"] is not None else "(to the end)",
                      fmt_stat(table_delta(r["kind"], r["delta"]), 3), e(r["size"]) or "-",
                      sigma_cell(r["delta_sigma"]), fmt(r["first_nonfinite_step"]),
                      fmt(r["steps_compared"]), e(metric_note(s, r["key"]) if s else "") or "-"],
                     {"diverged": "hit", "not_enough_steps": "thin"}.get(r["status"], "")))
    needed = c.summaries[0].steps_needed if c.summaries else None
    note = (f'<p class="note">A metric needs {needed} compared steps (candidate and a reference both logged, '
            'the band defined) before "no departure" means anything: fewer is "not enough steps".</p>'
            if needed else "")
    if c.reference_note:
        note += f'<p class="note">{e(c.reference_note)}</p>'
    return (note + _table(["candidate", "metric", "status", "alert (onset)", "kind", "end step", "delta",
                      "size (vs reference)", "delta (sigma)", "first non-finite step", "steps compared", "note"],
                      rows, {3, 5, 6, 8, 9, 10}))


def _when(r: dict) -> str:
    """A divergence row's alert step, its onset beside it where it differs: "125 (120)" (kept on one line),
    "4", "-"."""
    if r["onset_step"] is None:
        return "-"
    alert = r["alert_step"] if r["alert_step"] is not None else r["onset_step"]
    return fmt(alert) + (f"&nbsp;({fmt(r['onset_step'])})" if alert != r["onset_step"] else "")


def _causes(c: ReportContent) -> str:
    """One line per candidate (its first likely cause), the ranked list with its evidence folded under it."""
    labels, items, details = c.labels, [], []
    for rc in c.causes:
        line = rc.line()
        if line:
            items.append(f"<li><b>{e(labels[rc.run_id])}</b>: {e(line)}</li>")
        if not rc.causes:
            continue
        rows = [([str(i), e(x.title) + (f' <span class="note">({e(x.hint)})</span>' if x.hint else ""),
                  "<br>".join(map(e, x.signature)) or "-", "<br>".join(map(e, x.settings)) or "-", e(x.fix),
                  e(x.source)], "") for i, x in enumerate(rc.causes, 1)]
        also = (f'<p class="note">Also differs, with no signature of its own in these metrics: '
                f'{e("; ".join(rc.also_differs))}</p>' if rc.also_differs else "")
        details.append(f"<details><summary>{e(labels[rc.run_id])}: {len(rc.causes)} likely cause(s), ranked"
                       f"</summary>{_table(['#', 'cause', 'metrics', 'settings', 'fix', 'source'], rows, {0})}"
                       f"{also}</details>")
    if not items:
        return "<p>No likely cause: no candidate shows the signature of a known cause.</p>"
    return "<ul>" + "".join(items) + "</ul>" + "".join(details)


def _nan_events(c: ReportContent) -> str:
    """The NaN episodes, then the scaler overflows and NaN losses with finite gradients, said apart."""
    over, loss = step_event_lines(c.histories, [r.run_id for r in c.runs], c.labels, c.params)
    return _nan_episodes(c) + "".join(f"<p><strong>{e(x)}</strong></p>" for x in loss) + "".join(
        f"<p>{e(x)}</p>" for x in over)


def _nan_episodes(c: ReportContent) -> str:
    """One row per run and episode (`nan_episodes`), the per-step detail folded under it."""
    ev = c.nan_events
    unchecked = unchecked_text(c.unchecked, c.labels)
    if ev.empty:
        return (f"<p>{e(unchecked)} No step with a non-finite gradient among the checked steps.</p>" if unchecked
                else "<p>No step with a non-finite gradient in any run.</p>")
    labels = c.labels
    episodes = nan_episodes(ev, c.histories, [r.run_id for r in c.runs])
    rows = [([e(labels[ep.run_id]), e(ep.steps_text), fmt(len(ep.rows)), e(ep.norm_text),
              e(origin_text(ep, c.alerts)), e(ep.skipped_text), e(ep.params_text), e(ep.positions_text),
              e(ep.source_text)], "") for ep in episodes]
    table = _table(["run", "steps", "# steps", "grad norm", "where it entered", "optimizer", "parameters",
                    "samples / tokens", "source"], rows, {2})
    budget = MAX_EVENT_ROWS
    details = []
    for ep in episodes:
        shown = ep.rows.head(max(budget, 0))
        budget -= len(shown)
        names = ep.params
        same = ep.same_params  # then listed once above the steps
        per_step = [([fmt(r["step"]), fmt(r["grad_norm"]), e(r["positions"] or "-")]
                     + ([] if same else [e(r["params"] or "-")]), "") for r in shown.to_dict("records")]
        header = ["step", "grad norm", "samples / tokens"] + ([] if same else ["parameters"])
        more = (f'<p class="note">{len(ep.rows) - len(shown)} more steps not listed; the charts mark every one.</p>'
                if len(shown) < len(ep.rows) else "")
        listed = (f"<p>Parameter tensors ({len(names)}): <code>{e(', '.join(names))}</code></p>"
                  if same and names else "")
        details.append(f"<details><summary>{e(labels[ep.run_id])}, {e(ep.steps_label)}: every step</summary>"
                       f"{listed}{_table(header, per_step, {0, 1})}{more}</details>")
    note = f"<p>{e(unchecked)}</p>" if unchecked else ""
    return note + table + "".join(details)


def _nonfinite(c: ReportContent) -> str:
    if c.nonfinite.empty:
        return "<p>Every charted metric is finite at every logged step.</p>"
    labels = c.labels
    rows = [([e(labels[r["run_id"]]), e(r["key"]), str(r["nan"]), str(r["posinf"]), str(r["neginf"]),
              e(format_ranges(r["steps"], limit=40))], "") for r in c.nonfinite.to_dict("records")]
    return _table(["run", "metric", "NaN", "+inf", "-inf", "at steps"], rows, {2, 3, 4})


def _config(c: ReportContent) -> str:
    diff = c.config_diff  # without the alert tags (content.ALERT_TAGS): the NaN section says them in words
    if diff.empty:
        return "<p>Every param and tag is the same in all runs.</p>"
    labels = [r.label for r in c.runs]
    refs = [r.label for r in c.runs if r.role == "reference"] or labels[:1]
    # marked against the value every reference shares (against the first reference, each candidate's seed
    # would differ); a row where the references disagree among themselves flags no candidate
    base = shared_values(diff, refs)
    rows = []
    for (group, kind, name, *values), shared in zip(diff.itertuples(index=False), base):
        cells = []
        for label, v in zip(labels, values):
            text = e(_cell(fmt_value(v)))
            marked = label not in refs and shared is not None and value_key(v) != shared
            cells.append(f'<span class="differs">{text}</span>' if marked else text)
        what = f"<code>{e(name)}</code>" + (' <span class="varies">(varies across references)</span>'
                                             if shared is None and len(refs) > 1 else "")
        rows.append(([e(group), e(kind), what, *cells], ""))
    return _table(["group", "kind", "name", *(e(label) for label in labels)], rows)


def _cell(text: str) -> str:
    """A config value short enough for a table cell (a long one: its start and how long it is)."""
    return text if len(text) <= MAX_CONFIG_CHARS else f"{text[:MAX_CONFIG_CHARS]}... ({len(text)} characters)"


def _worst(c: ReportContent) -> str:
    """The worst-token section, only when a run logged `mismatch/worst/*`."""
    lines = worst_token_lines(c.histories, c.labels)
    if not lines:
        return ""
    items = "".join(f"<li>{e(x)}</li>" for x in lines)
    return f'<section id="worst"><h2>Worst tokens (trainer vs engine)</h2><ul>{items}</ul></section>\n'


PLOTLY_FILE = "plotly.min.js"  # `rldiag report --all-groups` writes it once beside the group folders


def render_html(c: ReportContent, *, plotly_src: str | None = None) -> str:
    """The whole page; see the module docstring. `plotly_src`: a relative path to plotly.js (a file written
    once beside many reports, `PLOTLY_FILE`) instead of its 4.8 MB inlined in the page."""
    csp, plotly = (CSP, f"<script>{plotly_js()}</script>") if plotly_src is None else (
        CSP.replace("script-src ", "script-src 'self' file: ", 1), f'<script src="{e(plotly_src)}"></script>')
    charts = "".join(f'<div class="chart" id="chart-{i}" data-key="{e(k)}"></div>' for i, k in enumerate(c.keys))
    specs = "\n".join(f'<script type="application/json" data-chart="chart-{i}">{_figure_json(c.figures[k])}</script>'
                      for i, k in enumerate(c.keys))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{csp}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>rldiag report: {e(c.title)}</title>
<style>{_CSS}</style>
{plotly}
</head><body>
<header><h1>rldiag report: {e(c.title)}</h1>
<p class="meta">Store {e(c.store_uri)} &middot; generated {e(c.generated_utc)} &middot; {len(c.keys)} metrics
&middot; detector options: {e(c.detector)}</p>
<nav><a href="#verdict">Verdict</a><a href="#charts">Charts</a><a href="#divergence">Divergence</a>
<a href="#runs">Runs</a><a href="#nan">Non-finite gradients</a><a href="#nonfinite">Non-finite values</a>
<a href="#config">Config diff</a></nav>
</header>
<section id="verdict"><h2>Verdict</h2>{_verdict(c)}</section>
<section id="charts"><h2>Metrics</h2>
<p class="note">Lines keep every bucket's min and max; NaN (x) and +inf/-inf (triangles) sit in the grey strip
above each plot, one row per run; dashed line and diamond: where a candidate leaves the reference band.</p>
<div class="grid">{charts}</div></section>
<section id="divergence"><h2>Divergence from the references, per metric</h2>{_divergence(c)}</section>
<section id="causes"><h2>Likely causes</h2>{_causes(c)}</section>
<section id="runs"><h2>Runs</h2>{_runs(c)}</section>
<section id="nan"><h2>Non-finite gradients</h2>{_nan_events(c)}</section>
<section id="nonfinite"><h2>Non-finite metric values</h2>{_nonfinite(c)}</section>
{_worst(c)}<section id="config"><h2>Config differences</h2>{_config(c)}</section>
{specs}
<script>{_LOADER}</script>
</body></html>
"""
