"""The README's figures: each experiment's runs overlaid, drawn by the dashboard's own figure code and
saved as PNG by Debian's Chromium (launched as the browser tests launch it, `tests.helpers.browser.chromium`).

    rldiag experiment masked-vs-unmasked && rldiag experiment engine-parity   # into ./mlruns.db
    python -m bench.readme_figures                                # -> experiments/figures/*.png
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from rldiag.app.analysis.divergence import detect_divergence
from rldiag.app.data.histories import load_histories
from rldiag.app.data.runs import find_runs
from rldiag.app.data.store import open_store
from rldiag.app.plots.figures import ChartOptions, metric_figure, run_colors
from rldiag.collectors import keys
from rldiag.collectors.settings import default_tracking_uri

OUT = Path(__file__).resolve().parent.parent / "experiments" / "figures"
FIGURES = {  # file name: (rldiag.group, metrics, caption)
    "masked_vs_unmasked": ("masked_vs_unmasked", [keys.LOSS, keys.GRAD_NORM],
                           "loss stays finite while grad/norm is NaN from step 1 (markers at the top edge)"),
    "engine_parity": ("v0_vs_v1", [keys.MISMATCH_LOGPROB_MEAN, keys.RATIO_MEAN, keys.CLIP_RATE_SEQ,
                                   keys.REWARD_MEAN],
                      "v0-parity seeds (black/grey) vs V1 defaults and one knob at a time"),
}


def page(uri: str, group: str, metrics: list[str], caption: str) -> str:
    """An HTML page with one chart per metric, every run of `group` overlaid, references emphasised."""
    runs = find_runs(open_store(uri), group=group)
    runs = runs.sort_values(["role", "name"], ascending=[False, True])  # references first
    ids = runs.run_id.tolist()
    refs = runs.run_id[runs.role == "reference"].tolist()
    labels = dict(zip(runs.run_id, runs.name))
    h = load_histories(open_store(uri), ids, metrics)
    colors = run_colors(ids, refs)
    divs = []
    for i, key in enumerate(metrics):
        traces = h.for_key(key, ids)
        ref_traces = [traces[r] for r in refs if r in traces]
        div = {c: detect_divergence(ref_traces, t) for c, t in traces.items() if c not in refs and ref_traces}
        fig = metric_figure(key, traces, labels=labels, reference_ids=refs, colors=colors, divergences=div,
                            options=ChartOptions(height=360))
        fig.update_layout(width=620, legend=dict(font=dict(size=9)))
        divs.append(fig.to_html(full_html=False, include_plotlyjs=(i == 0)))
    cells = "".join(f"<div style='display:inline-block'>{d}</div>" for d in divs)
    return (f"<html><body style='margin:0;background:#fff;font-family:sans-serif;width:1260px'>"
            f"<p style='margin:6px 12px;font-size:13px'>{caption}</p>{cells}</body></html>")


def save_png(html: str, path: Path) -> None:
    from tests.helpers.browser import chromium

    with tempfile.TemporaryDirectory() as d, chromium() as browser:
        f = Path(d) / "page.html"
        f.write_text(html)
        pg = browser.new_page(viewport={"width": 1260, "height": 800})
        pg.goto(f.as_uri())
        pg.wait_for_function("() => document.querySelectorAll('.js-plotly-plot .main-svg').length > 0")
        pg.wait_for_timeout(500)
        pg.screenshot(path=str(path), full_page=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tracking-uri", default=None, help="the store the experiments wrote (default: ./mlruns.db)")
    ap.add_argument("--only", choices=sorted(FIGURES), action="append", help="just this figure (repeatable)")
    args = ap.parse_args(argv)
    uri = args.tracking_uri or default_tracking_uri()
    OUT.mkdir(exist_ok=True)
    for name in args.only or FIGURES:
        group, metrics, caption = FIGURES[name]
        path = OUT / f"{name}.png"
        save_png(page(uri, group, metrics, caption), path)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
