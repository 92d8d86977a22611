"""One verdict on the experiments' own runs (issue 41's bar): the masked-vs-unmasked reproduction, run for
real into a SQLite store, then `rldiag report --group` (HTML and Markdown), the Compare page and `rldiag
watch` read it; each candidate gets the same verdict, the same "departs" (the first non-finite step) and
the same likely cause in all of them. tests/app/test_one_verdict.py does the same on runs with level
departures (alert and onset)."""

from __future__ import annotations

import html
import re

import pytest

from rldiag.app.analysis.verdicts import STATUS_WORDS, rows_of
from tests.helpers.experiments import run_mvu

STEPS = 3
GROUP = "masked_vs_unmasked"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return run_mvu(tmp_path_factory.mktemp("one-verdict-mvu"), STEPS, "one-verdict")[0]


def _html_rows(markup: str) -> dict[str, tuple[str, ...]]:
    """{candidate: (verdict, departs, likely cause)} of the HTML verdict table in `markup`."""
    [table] = [t for t in re.findall(r"<table>(.*?)</table>", markup, re.DOTALL) if "<th>departs</th>" in t]
    rows = [[html.unescape(re.sub(r"<[^>]+>", "", c)) for c in re.findall(r"<td[^>]*>(.*?)</td>", r, re.DOTALL)]
            for r in re.findall(r"<tr[^>]*>(.*?)</tr>", table.split("<tbody>", 1)[1], re.DOTALL)]
    return {r[0]: tuple(r[1:4]) for r in rows}


def _md_rows(markdown: str) -> dict[str, tuple[str, ...]]:
    block = markdown.split("### Verdict", 1)[1].split("###", 1)[0]
    rows = [line.strip("| ").split(" | ") for line in block.splitlines() if line.startswith("| ")][1:]
    return {r[0]: tuple(c.replace("\\", "") for c in r[1:4]) for r in rows}


def test_the_experiments_runs_get_one_verdict_in_the_report_the_page_and_the_watcher(store, monkeypatch):
    from rldiag.app.report.build import build_report
    from rldiag.app.watch.loop import watch_once
    from tests.helpers.dashboard import app

    report = build_report(store, group=GROUP)
    labels = report.labels
    expected = {r.run: (r.verdict, r.departs, r.cause)
                for r in rows_of(report.content.summaries, report.content.causes, labels)}
    nan = {"unmasked-b1xa2", "unmasked-b2xa1"}  # batch x accumulation > 1 without the fix
    assert set(expected) == {"unmasked-b1xa1", *nan}
    for name in nan:
        verdict, departs, cause = expected[name]
        assert verdict == STATUS_WORDS["nonfinite"] and departs == "grad/finite 0 at step 1", expected[name]
        assert cause.startswith("-inf padding"), cause
    assert expected["unmasked-b1xa1"][0] != STATUS_WORDS["within"]  # 3 steps: never an all-clear

    assert _html_rows(report.html) == expected
    assert _md_rows(report.markdown) == expected

    at = app(store, monkeypatch, "compare")
    ids = {v: k for k, v in labels.items()}
    refs = [ids[n] for n in labels.values() if n.startswith("masked")]
    at.sidebar.multiselect(key="sidebar.reference").set_value(refs)
    at.sidebar.multiselect(key="sidebar.candidates").set_value([ids[n] for n in expected]).run()
    assert not at.exception, [e.value for e in at.exception]
    [table] = [m.value for m in at.html if "<th>departs</th>" in m.value]
    assert _html_rows(table) == expected

    # the watcher: the first alert of each NaN run, at the step the verdict's "departs" names, in its words
    _, events = watch_once(store, divergence=True)
    for name in nan:
        verdict, departs, cause = expected[name]
        first = min((e for e in events if e["run_name"] == name and e["kind"] == "nonfinite_grad"),
                    key=lambda e: e["step"])
        assert f"at step {departs.rsplit(' ', 1)[1]}:" in first["text"] and verdict in first["text"], first["text"]
        assert f"likely: {cause}" in first["text"], first["text"]
    assert not [e for e in events if e["run_name"] == "unmasked-b1xa1"]
