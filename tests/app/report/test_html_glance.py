"""The HTML report answers at a glance, on the real masked-vs-unmasked reproduction (issue 18 items 1-3, 8).

One real store: `rldiag experiment masked-vs-unmasked` with 12 steps and configs 1x1, 1x2 and 2x1, i.e.
six runs (masked/unmasked x 3 configs); unmasked-b1xa2 and unmasked-b2xa1 have NaN gradients at every
step 1-12 (the same steps), in all 30 parameter tensors of the tiny policy, their alerts files naming
them and the padded token positions.
"""

from __future__ import annotations

import html
import re

import pytest

from rldiag.app.report.build import build_report
from rldiag.experiments import masked_vs_unmasked as mvu
from tests.helpers.browser import chromium, screenshot
from tests.helpers.experiments import run_mvu

STEPS = 12


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mvu-report")
    uri = run_mvu(tmp, STEPS, "mvu", configs=((1, 1), (1, 2), (2, 1)))[0]
    rep = build_report(uri, group=mvu.GROUP)
    path = tmp / "report.html"
    rep.write(path)
    return rep, path


def _section(page: str, sid: str) -> str:
    return page.split(f'<section id="{sid}">', 1)[1].split("</section>", 1)[0]


def _rows(section: str) -> list[list[str]]:
    """The cells (tags stripped) of the first table's body rows."""
    body = section.split("<tbody>", 1)[1].split("</tbody>", 1)[0]
    return [[re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<td[^>]*>(.*?)</td>", row)]
            for row in re.findall(r"<tr[^>]*>(.*?)</tr>", body)]


def test_nan_section_is_one_row_per_episode_with_the_steps_behind_it(report):
    rep, _ = report
    nan = _section(rep.html, "nan")
    # 12 NaN steps of a run are one episode row (was: 12 rows, each listing the 30 tensor names)
    rows = _rows(nan)
    assert [r[0] for r in rows] == ["unmasked-b1xa2", "unmasked-b2xa1"]
    row = rows[0]
    assert row[1:4] == [f"1-{STEPS}", str(STEPS), "NaN"]
    # where it entered, as the collectors' alert says (the padded tokens of the loss's backward)
    assert html.unescape(row[4]).startswith("NaN entered from the loss's backward (the loss was finite)")
    # the experiment's policy is skip: the optimizer did not step on these gradients
    assert row[5] == "skipped: the weights did not change"
    assert row[6] == "30 parameter tensors, the same at every step"
    # the padded samples, each with its count of token positions: "micro-batch 1 sample 0: 21 token positions; ..."
    assert re.fullmatch(r"micro-batch \d sample \d: \d+ token positions(; micro-batch \d sample \d: \d+ token "
                        r"positions)*", row[7]), row[7]
    # the detail is folded: the names once, every step's positions in a closed <details>
    details = re.findall(r"<details>.*?</details>", nan, re.S)[0]
    assert details.count("head.weight") == 1 and details.count("<tr") == STEPS + 1  # header + one per step
    assert "<details open" not in nan


def test_config_table_has_no_alert_blob_and_sections_put_the_answer_first(report):
    rep, _ = report
    config = _section(rep.html, "config")
    assert "rldiag.alert" not in config and '"positions"' not in config  # was a 2 KB JSON per NaN run
    assert max(len(c) for r in _rows(config) for c in r) < 200
    order = re.findall(r'<section id="(\w+)">', rep.html)
    assert order[:2] == ["verdict", "charts"] and order.index("divergence") > order.index("charts")
    assert order.index("runs") > order.index("charts") and order.index("nan") > order.index("charts")


# The NaN markers of grad/norm: per trace, its name, colour and the page y of its first marker.
MARKERS_JS = """() => { const c = [...document.querySelectorAll('.chart')].find(c => c.dataset.key === 'grad/norm');
    const ya = c._fullLayout.yaxis2;  // the hidden [0, 1] marker axis: where plotly.js placed the markers
    return c._fullData.filter(t => / NaN$/.test(t.name)).map(t => [t.name, t.marker.color,
        ya._offset + ya.l2p(t.y[0])]); }"""
# Each drawn chart: its legend's entries, the boxes of the legend and the x axis title (page pixels).
BOXES_JS = """() => [...document.querySelectorAll('.chart')].map(c => {
    const box = el => { if (!el) return null; const r = el.getBoundingClientRect();
                        return [r.left, r.top, r.right, r.bottom]; };
    return {key: c.dataset.key, legend: box(c.querySelector('.legend')), xtitle: box(c.querySelector('.g-xtitle')),
            names: [...c.querySelectorAll('.legendtext')].map(t => t.textContent), top: c.getBoundingClientRect().top,
            marker_key: [...c.querySelectorAll('.legendtitletext')].map(t => t.textContent)};
})"""


@pytest.mark.browser
def test_report_in_chromium_is_short_with_charts_first_and_legends_clear_of_the_axis(report):
    rep, path = report
    colors = {r.label: r.color for r in rep.content.runs}
    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1440, "height": 900})
        page.goto(path.as_uri())
        page.wait_for_function("() => [...document.querySelectorAll('.chart')].every(c => c._fullLayout)",
                               timeout=180_000)
        charts = {c["key"]: c for c in page.evaluate(BOXES_JS)}
        height = page.evaluate("() => document.documentElement.scrollHeight")
        markers = page.evaluate(MARKERS_JS)
        screenshot(page, "report-glance")
    # The first screen (900 px) holds the verdict and the first charts; no table comes before them.
    first = min(c["top"] for c in charts.values())
    assert first < 900, first
    # No legend covers its chart's "step" title (it sat on it, below the plot).
    for key, c in charts.items():
        lx0, ly0, lx1, ly1 = c["legend"]
        tx0, ty0, tx1, ty1 = c["xtitle"]
        assert lx1 <= tx0 or tx1 <= lx0 or ly1 <= ty0 or ty1 <= ly0, (key, c["legend"], c["xtitle"])
    # grad/norm of unmasked-b1xa2 is NaN at every step: the run keeps its legend entry, its markers go under
    # it; each chart's legend: one entry per run, none per marker kind, and one key to the markers it draws
    grad = charts["grad/norm"]
    assert "unmasked-b1xa2" in grad["names"] and len(grad["names"]) == len(set(grad["names"]))
    assert not [n for c in charts.values() for n in c["names"] if n.startswith("diverges: ") or n.endswith(" NaN")]
    assert len(grad["marker_key"]) == 1 and "NaN" in grad["marker_key"][0].split()
    assert len(set(colors.values())) == len(colors)  # six runs, six colours
    # Two runs NaN at the same steps: both show, each in its colour, one a few pixels below the other
    (a, color_a, y_a), (b, color_b, y_b) = markers
    assert (a, b) == ("unmasked-b1xa2 NaN", "unmasked-b2xa1 NaN") and (color_a, color_b) == (
        colors["unmasked-b1xa2"], colors["unmasked-b2xa1"])
    assert y_b - y_a > 5  # 0.04 of a ~225 px plot area: about 9 px
    # 6 runs x 12 steps: the page was 20,926 px at 6 runs x 40 steps before the NaN episodes; each of
    # these 24 NaN steps used to be a table row of about 130 px (30 names), now one row a run and a folded list.
    assert height < 6000, height


def test_the_verdict_section_says_why_before_any_chart(report):
    """As the Compare page above its charts: per candidate its verdict, where it departs, its likely cause and
    the fix, in the report's first section."""
    rep, _ = report
    verdict = _section(rep.html, "verdict")
    assert "<th>likely cause</th>" in verdict and rep.html.index('id="verdict"') < rep.html.index('id="charts"')
    rows = {r[0]: r[1:] for r in _rows(verdict)}
    for name in ("unmasked-b1xa2", "unmasked-b2xa1"):
        assert rows[name][:2] == ["non-finite gradients", "grad/finite 0 at step 1"], rows[name]
        assert rows[name][2].startswith("-inf padding") and "mask padding" in rows[name][3], rows[name]
