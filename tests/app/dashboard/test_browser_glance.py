"""The dashboard answers at a glance, in a real Chromium (issue 18 items 1-4, 7, 8): a chart above the
fold at 1280x800, markers in their run's colour with legend entries, one colour per run (the report's
too), the log scale marking what it drops, NaN episodes one row each with nothing cut, a config diff
that fits 11 runs with the differences first, run names whole in the sidebar."""

from __future__ import annotations

import html
import re

import pytest

from rldiag.app.report.build import build_report
from rldiag.collectors import keys
from tests.helpers.browser import READY, chromium, drawn, screenshot, serve
from tests.helpers.dash_store import GROUP
from tests.helpers.net import stop_group
from tests.helpers.runs import write_run

# Per drawn trace: name, line/marker colour, x and y (y as plotly drew it: NaN for a line break).
TRACES_JS = """() => [...document.querySelectorAll('.js-plotly-plot')].filter(p => p._fullData).flatMap(p => {
    const titles = Object.fromEntries((p._fullLayout.annotations || []).filter(a => / domain$/.test(a.xref))
        .map(a => [a.xref.split(' ')[0], a.text]));
    return p._fullData.map(t => ({panel: titles[t.xaxis || 'x'], name: t.name, line: t.line && t.line.color,
        marker: t.marker && t.marker.color, x: Array.from(t.x || []),
        y: Array.from(t.y || []).map(v => v === null ? NaN : v)}));
})"""
# The top of the first panel's plot area (page pixels).
FIRST_PANEL_TOP_JS = """() => {
    const r = document.querySelector('.rldiag-chart-grid .nsewdrag').getBoundingClientRect();
    return r.top + window.scrollY; }"""
# Every text cell of a static table (st.table) or the config table that shows less than its content.
CUT_CELLS_JS = """(sel) => [...document.querySelectorAll(sel)].filter(c => c.scrollWidth > c.clientWidth + 1)
    .map(c => c.textContent)"""
# The sidebar's run chips: their text and whether it is cut (ellipsis or hidden overflow).
CHIPS_JS = """() => [...document.querySelectorAll('[data-testid="stSidebar"] [data-tag]')].map(t => {
    const s = t.querySelector('span[title]'), bar = document.querySelector('[data-testid="stSidebar"]');
    return [s.textContent, s.scrollWidth > s.clientWidth + 1,
            t.getBoundingClientRect().right <= bar.getBoundingClientRect().right]; })"""


@pytest.mark.browser
def test_compare_and_nan_events_at_1280x800(dash_store, tmp_path):
    report = build_report(dash_store.uri, group=GROUP)  # the report's colours, for the same runs
    report_colors = {r.label: r.color for r in report.content.runs}
    proc, url, _ = serve(dash_store.uri, tmp_path)
    try:
        with chromium() as browser:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.set_default_timeout(180_000)
            page.goto(url + "compare")
            drawn(page, {keys.GRAD_NORM: {"unmasked", "unmasked NaN"}})
            # the draft grid is drawn first, the verdicts table above it once they are computed: measure the
            # page its script finished (CI's busy cores once measured the draft's top under the late table)
            page.wait_for_selector(READY)
            page.wait_for_timeout(500)
            # The why above the fold (issue 44): each candidate's verdict, departure and likely cause with its
            # fix, in a table that ends inside the first screen, before the first chart panel.
            top = page.evaluate(FIRST_PANEL_TOP_JS)
            verdicts = page.locator(".rldiag-table", has_text="likely cause").first.bounding_box()
            screenshot(page, "glance-compare-1280")
            assert verdicts["y"] + verdicts["height"] < 800 and verdicts["y"] + verdicts["height"] <= top, (
                verdicts, top)
            traces = page.evaluate(TRACES_JS)
            lines = {t["name"]: t["line"] for t in traces if t["panel"] == keys.RATIO_MEAN and t["line"]
                     and not re.search(r" band \(\d+-step median\)$| \d+-step median$", t["name"])}  # runs only
            # One colour per run, the report's: every picked run drawn in the colour the report gives it.
            assert {n: c for n, c in lines.items() if n in report_colors} == {
                n: report_colors[n] for n in lines if n in report_colors}
            assert len(set(lines.values())) == len(lines)  # 6 runs, 6 colours
            grad = {t["name"]: t for t in traces if t["panel"] == keys.GRAD_NORM}
            assert grad["unmasked NaN"]["marker"] == grad["unmasked"]["line"]  # the NaN marker in its run's colour
            legend = page.locator(".rldiag-chart-grid .legendtext").all_text_contents()
            # one entry per run (it listed each marker kind of each run: up to 19 entries), markers under
            # their run; one key, the legend's title, to the NaN, +inf and departure markers drawn
            drawn_runs = {html.unescape(n) for n in lines}  # trace names are escaped, the legend's text is not
            assert {"unmasked", "v1 shifted"} | drawn_runs <= set(legend) and len(legend) == len(set(legend)), legend
            assert not [n for n in legend if n.startswith("diverges: ") or n.endswith((" NaN", " +inf", " -inf"))]
            key = page.locator(".rldiag-chart-grid .legendtitletext").all_text_contents()
            assert len(key) == 1 and {"NaN", "+inf", "alert", "onset"} <= set(key[0].split()), key
            # Log scale of each run minus the reference: about half the values are <= 0. They break the
            # line, are marked at the bottom and counted in the panel's title.
            page.get_by_text("Chart options").click()
            page.get_by_text("Delta vs reference").click()
            page.get_by_text("Log scale").click()
            title = f"{keys.RATIO_MEAN} (minus reference) · "  # then the count of points it cannot draw
            page.wait_for_function(f"() => ({TRACES_JS})().some(t => t.panel && t.panel.startsWith({title!r}) "
                                   "&& t.name === 'v1 shifted ≤ 0')")
            titles = page.locator(".rldiag-chart-grid .annotation-text").all_text_contents()
            assert any(t.startswith(title) and "not on the log scale" in t for t in titles), titles
            shifted = {t["name"]: t for t in page.evaluate(TRACES_JS) if t["panel"] and t["panel"].startswith(title)}
            below = shifted["v1 shifted ≤ 0"]
            # v1 shifted is above the reference after its shift at 150: its points <= 0 are before it
            assert len(below["x"]) > 20 and max(below["x"]) < 200
            assert any(v != v for v in shifted["v1 shifted"]["y"])  # NaN: the line breaks there

            # NaN events: one row per episode, no cell cut, every step in an expander.
            page.goto(url + "nan-events")
            page.wait_for_selector(READY)
            page.get_by_text("Steps with non-finite gradients").wait_for()
            # the table comes after its heading, once the episodes are computed (seconds on a loaded machine)
            rows = page.locator(".rldiag-table").first.locator("tbody tr")
            rows.first.wait_for()
            assert rows.count() == 3  # unmasked: 40-41, 200, 250
            assert page.evaluate(CUT_CELLS_JS, ".rldiag-table td") == []
            page.get_by_text("unmasked, step 200: every step").click()
            page.get_by_text("sample 1 token 3").wait_for()
            screenshot(page, "glance-nan-events")
    finally:
        stop_group(proc)


@pytest.mark.browser
def test_config_diff_of_eleven_runs_fits_with_the_differences_first(tmp_path, template_db):
    import shutil

    path = tmp_path / "mlruns.db"
    shutil.copyfile(template_db, path)
    uri = f"sqlite:///{path}"
    base = {"engine.logprobs_mode": "processed_logprobs", "engine.enable_prefix_caching": "False",
            "trainer.per_device_batch_size": 4, "trainer.gradient_accumulation_steps": 2, "lr": 1e-6}
    steps = [(s, {keys.RATIO_MEAN: 1.0, keys.GRAD_NORM: 1.0, keys.GRAD_FINITE: 1.0}) for s in range(5)]
    names = ["reference-processed-logprobs-seed-0"] + [f"candidate-seed-{i:02d}-long-run-name" for i in range(10)]
    for i, name in enumerate(names):
        params = dict(base, **({"engine.logprobs_mode": "raw_logprobs"} if i == 10 else {}))
        write_run(uri, experiment="wide", name=name, params=params, steps=steps,
                  tags={keys.TAG_GROUP: "wide", keys.TAG_ROLE: "reference" if i == 0 else "candidate"})
    proc, url, _ = serve(uri, tmp_path)
    try:
        with chromium() as browser:
            page = browser.new_page(viewport={"width": 1440, "height": 900})
            page.set_default_timeout(180_000)
            page.goto(url + "config-diff")
            table = page.locator(".rldiag-config table")
            table.wait_for()
            page.wait_for_selector(READY)
            heads = table.locator("th").all_text_contents()
            # the reference, then the one candidate that differs (newest-last order would put it last)
            assert heads[1:3] == [f"{names[0]} (reference)", names[10]]
            # 11 runs fit: the table is no wider than the window, no cell cut
            width = page.evaluate("() => document.querySelector('.rldiag-config table').getBoundingClientRect().right")
            assert width <= 1440 and page.evaluate(CUT_CELLS_JS, ".rldiag-config td, .rldiag-config th") == []
            # cells that differ from the reference are marked: one logprobs mode, and each candidate's role tag
            marked = table.locator("td.d").all_text_contents()
            assert marked.count("raw_logprobs") == 1 and sorted(set(marked)) == ["candidate", "raw_logprobs"]
            n_rows = table.locator("tbody tr").count()
            page.get_by_text("Show identical rows too").click()
            page.wait_for_function(f"() => document.querySelectorAll('.rldiag-config tbody tr').length > {n_rows}")
            assert page.locator(".rldiag-config tr.same").count() > 0  # greyed identical rows, after
            # the sidebar shows every picked run's name whole (chips wrap; nothing cut or outside it)
            chips = page.evaluate(CHIPS_JS)
            assert len(chips) == 11 and all(not cut and inside for _, cut, inside in chips), chips
            screenshot(page, "glance-config-diff")
    finally:
        stop_group(proc)
