"""Never more than the evidence (issue 41): no all-clear, on the Compare page or in the report, for a
candidate whose metric stops before the references' last step, that never logged a metric a reference
logged, or whose gradients were never checked (grad/found 0); the page and the report name what is
missing. A complete seed of the reference still gets the all-clear. Real runs in a SQLite store."""

from __future__ import annotations

import numpy as np
import pytest

from rldiag.app.report.build import build_report, departure_lines
from rldiag.collectors import keys
from tests.helpers.dashboard import app, unescape_md
from tests.helpers.runs import write_run

N = 200
KEYS = (keys.LOSS, keys.REWARD_MEAN, keys.GRAD_NORM)


def _run(uri: str, name: str, role: str, seed: int, *, reward_to: int = N, found: float | None = None) -> str:
    # the same distribution in every run: loss ~ 1 + N(0, 0.05), reward ~ 0.5 + N(0, 0.1), grad norm ~ 1 + N(0, 0.05)
    rng = np.random.default_rng(seed)
    steps = []
    for s in range(N):
        m = {keys.LOSS: 1.0 + 0.05 * rng.standard_normal(), keys.GRAD_NORM: 1.0 + 0.05 * rng.standard_normal(),
             keys.GRAD_FINITE: 1.0, keys.REWARD_MEAN: 0.5 + 0.1 * rng.standard_normal()}
        if s >= reward_to:
            del m[keys.REWARD_MEAN]
        if found is not None:
            m[keys.GRAD_FOUND] = found
        steps.append((s, m))
    return write_run(uri, experiment="evidence", name=name, steps=steps,
                     tags={keys.TAG_GROUP: "g", keys.TAG_ROLE: role, keys.TAG_SEED: str(seed)})


CASES = {  # candidate -> what the page and the report must name
    "stops": ({"reward_to": 60}, "reward/mean stops at step 59 of 199"),
    "unchecked": ({"found": 0.0}, "gradients never checked (grad/found 0 at every step)"),
    "no_reward": ({"reward_to": 0}, "never logged (a reference did): reward/mean"),
}


@pytest.fixture
def runs(store_uri):
    ids = {"ref": _run(store_uri, "ref", "reference", 0, found=1.0),
           "seed": _run(store_uri, "seed", "candidate", 1, found=1.0)}
    for name, (kw, _) in CASES.items():
        ids[name] = _run(store_uri, name, "candidate", 2 + len(ids), **kw)
    return store_uri, ids


def _page(at, ref: str, cands: list[str]):
    at.sidebar.multiselect(key="sidebar.reference").set_value([ref])
    at.sidebar.multiselect(key="sidebar.candidates").set_value(cands)
    at.multiselect(key="compare.metrics").set_value(list(KEYS)).run()
    assert not at.exception, [e.value for e in at.exception]
    [glance] = [unescape_md(m.value).replace("**", "") for m in at.markdown if "below the charts" in m.value]
    lines = "\n".join(unescape_md(m.value) for m in at.markdown if m.value.startswith("- **"))
    return glance, [unescape_md(s.value) for s in at.success], lines


def test_the_page_names_what_is_missing_instead_of_an_all_clear(runs, monkeypatch):
    uri, ids = runs
    at = app(uri, monkeypatch, "compare")
    glance, banners, _ = _page(at, ids["ref"], [ids["seed"]])  # complete: the all-clear stands
    assert glance.startswith("No candidate leaves the reference") and banners, (glance, banners)
    assert banners[0].startswith("No candidate leaves the reference run on the metrics shown")
    for name, (_, missing) in CASES.items():
        glance, banners, lines = _page(at, ids["ref"], [ids["seed"], ids[name]])
        assert not banners and "No candidate leaves" not in glance, (name, glance)
        assert glance.startswith("No departure from the reference found, but not an all-clear: "
                                 f"{name}: {missing}"), (name, glance)
        assert missing in lines, (name, lines)


def test_the_report_names_what_is_missing(runs):
    uri, ids = runs
    report = build_report(uri, reference=ids["ref"], candidates=[ids["seed"], *(ids[n] for n in CASES)],
                          keys=list(KEYS))
    by_run = {s.run_id: s for s in report.summaries}
    assert by_run[ids["seed"]].clean
    lines = departure_lines(report)
    for name, (_, missing) in CASES.items():
        assert not by_run[ids[name]].clean, name
        [line] = [t for t in lines if t.startswith(f"{name}: ")]
        assert missing in line, line
        assert missing.replace("_", "\\_") in report.markdown or missing in report.markdown, name
    [seed] = [t for t in lines if t.startswith("seed: ")]
    assert "stays within the reference band on 3 metrics compared" in seed
    assert not any(m for _, m in CASES.values() if m in seed)


def _verdict_rows(markup: str) -> dict[str, str]:
    """{candidate: verdict} of the HTML verdict table in `markup` (the report's or the page's); {} without one."""
    import html
    import re

    tables = [t for t in re.findall(r"<table>(.*?)</table>", markup, re.DOTALL) if "<th>departs</th>" in t]
    if not tables:
        return {}
    rows = [[html.unescape(re.sub(r"<[^>]+>", "", c)) for c in re.findall(r"<td[^>]*>(.*?)</td>", r, re.DOTALL)]
            for r in re.findall(r"<tr[^>]*>(.*?)</tr>", tables[0].split("<tbody>", 1)[1], re.DOTALL)]
    return {r[0]: r[1] for r in rows}


@pytest.mark.parametrize("name", list(CASES))
def test_the_verdict_table_says_not_an_all_clear_where_nothing_departs(runs, monkeypatch, name):
    # no departure and no likely cause, but short of an all-clear: the report's top (its Verdict table, HTML and
    # Markdown) says so as the page's does; the table was left out where no candidate departed or had a cause,
    # so the report's first line for the candidate read "stays within the reference band"
    uri, ids = runs
    report = build_report(uri, reference=ids["ref"], candidates=[ids["seed"], ids[name]], keys=list(KEYS))
    expected = {"seed": "within the band", name: "no departure found, not an all-clear"}
    assert _verdict_rows(report.html) == expected
    block = report.markdown.split("### Verdict", 1)[1].split("###", 1)[0]
    md = {unescape_md(r[0]): r[1] for r in (line.strip("| ").split(" | ") for line in block.splitlines()
                                            if line.startswith("| "))}
    assert md == {"candidate": "verdict", "seed": "within the band", name: "no departure found, not an all-clear"}
    at = app(uri, monkeypatch, "compare")
    _page(at, ids["ref"], [ids["seed"], ids[name]])
    [table] = [m.value for m in at.html if "<th>departs</th>" in m.value]
    assert _verdict_rows(table) == expected
    # a clean candidate alone: the all-clear stands and no table repeats it
    clean = build_report(uri, reference=ids["ref"], candidates=[ids["seed"]], keys=list(KEYS))
    assert "### Verdict" not in clean.markdown and _verdict_rows(clean.html) == {}
