"""One comparison, one verdict (issue 41): for the same runs, the report (HTML and Markdown), the Compare page
and the watcher's events give each candidate the same verdict line: the verdict's words, the metric it
departs on and when (`verdicts.when_text`: "alerted at step A (started about step O)"), a burst that
ended never ahead of a lasting drift.

Real runs in a SQLite store through rldiag's writer, shaped as the experiments' are: three reference seeds
and candidates with a lasting shift (a mismatched engine), a warm-up burst that ends before a lasting
drift, NaN gradients, and a seed of the references."""

from __future__ import annotations

import html
import re

import numpy as np
import pytest

from rldiag.app.analysis.comparison import CompareOptions, compare, load_keys
from rldiag.app.analysis.divergence import DivergenceConfig
from rldiag.app.analysis.verdicts import STATUS_WORDS, departure_when, verdict_rows
from rldiag.app.data.histories import load_histories
from rldiag.app.data.store import open_store
from rldiag.collectors import keys as K
from tests.helpers.runs import write_run

N = 240
NAN_AT = (100, 101, 102)
KEYS = (K.RATIO_MEAN, K.ENTROPY, K.GRAD_NORM, K.LOSS)  # the Compare page's defaults among what the runs log
GROUP = "one_verdict"


def _series(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {K.RATIO_MEAN: 1 + 0.01 * rng.standard_normal(N), K.RATIO_MAX: 1.5 + 0.05 * rng.standard_normal(N),
            K.ENTROPY: 2 + 0.05 * rng.standard_normal(N),
            K.GRAD_NORM: 1 + 0.05 * rng.standard_normal(N), K.LOSS: 0.5 + 0.02 * rng.standard_normal(N),
            K.GRAD_FINITE: np.ones(N)}


def _write(uri: str, name: str, role: str, series: dict[str, np.ndarray]) -> str:
    steps = [(s, {k: float(v[s]) for k, v in series.items()}) for s in range(N)]
    return write_run(uri, experiment="one", name=name, steps=steps, tags={K.TAG_GROUP: GROUP, K.TAG_ROLE: role})


@pytest.fixture
def store(store_uri):
    for seed in range(3):
        _write(store_uri, f"ref{seed}", "reference", _series(seed))
    mismatch = _series(10)
    mismatch[K.RATIO_MEAN][120:] += 0.08  # 8 noise sd from step 120 to the end: a mismatched engine
    mismatch[K.RATIO_MAX][120:] += 1.0  # 20 noise sd: larger, on a metric the Compare page does not chart
    burst = _series(11)
    burst[K.ENTROPY][15:40] += 1.0  # a warm-up burst of 20 noise sd that ends ...
    burst[K.LOSS][150:] += 0.16  # ... before the real, lasting drift (8 noise sd)
    nan = _series(12)
    nan[K.GRAD_NORM][list(NAN_AT)] = np.nan
    nan[K.GRAD_FINITE][list(NAN_AT)] = 0.0
    cands = {"mismatch": mismatch, "burst": burst, "nan": nan, "seed": _series(13)}
    ids = {name: _write(store_uri, name, "candidate", s) for name, s in cands.items()}
    return store_uri, ids


def _cell_rows(markup: str) -> dict[str, tuple[str, str]]:
    """{candidate: (verdict, departs)} of the HTML verdict table in `markup` (the report's or the page's)."""
    [table] = [t for t in re.findall(r"<table>(.*?)</table>", markup, re.DOTALL) if "<th>departs</th>" in t]
    rows = [[html.unescape(re.sub(r"<[^>]+>", "", c)) for c in re.findall(r"<td[^>]*>(.*?)</td>", r, re.DOTALL)]
            for r in re.findall(r"<tr[^>]*>(.*?)</tr>", table.split("<tbody>", 1)[1], re.DOTALL)]
    return {r[0]: (r[1], r[2]) for r in rows}


def _md_rows(markdown: str) -> dict[str, tuple[str, str]]:
    """{candidate: (verdict, departs)} of the Markdown report's Verdict table, escapes undone."""
    block = markdown.split("### Verdict", 1)[1].split("###", 1)[0]
    rows = [line.strip("| ").split(" | ") for line in block.splitlines() if line.startswith("| ")][1:]
    return {r[0]: (r[1].replace("\\", ""), r[2].replace("\\", "")) for r in rows}


def test_report_page_and_watcher_give_each_candidate_the_same_verdict_line(store, monkeypatch):
    from rldiag.app.report.build import build_report
    from rldiag.app.watch.loop import watch_once
    from tests.helpers.dashboard import app

    uri, ids = store
    names = {v: k for k, v in ids.items()}
    # the one comparison, as every product runs it
    refs = [r.info.run_id for r in open_store(uri).client.search_runs(
        [open_store(uri).client.get_experiment_by_name("one").experiment_id],
        f"tags.`{K.TAG_ROLE}` = 'reference'")]
    h = load_histories(open_store(uri), [*refs, *ids.values()], list(load_keys(KEYS)))
    found = compare(h, refs, list(ids.values()), CompareOptions(KEYS, DivergenceConfig()))
    expected = {r.run: (r.verdict, r.departs) for r in verdict_rows(found, names)}
    leads = {names[v.run_id]: v.lead for v in found.verdicts}

    # what the runs are: the drift is the burst run's headline, the burst that ended listed after it
    assert expected["mismatch"][0] == expected["burst"][0] == STATUS_WORDS["diverged"], expected
    assert expected["mismatch"][1].startswith(f"{K.RATIO_MEAN} ") and leads["mismatch"].lead.lasting
    burst = found.verdicts[list(ids).index("burst")]
    assert burst.lead.key == K.LOSS and burst.lead.lead.lasting, burst.departures
    assert [d.key for d in burst.departures] == [K.ENTROPY, K.LOSS]  # the burst came first, and ended
    assert "came back after step" in departure_when(burst.departures[0].lead)
    assert expected["nan"] == (STATUS_WORDS["nonfinite"], f"grad/finite 0 at step {NAN_AT[0]}")
    assert expected["seed"] == (STATUS_WORDS["within"], "-")

    # the report as `rldiag report --group` makes it: every canonical metric the runs logged, ratio_max too
    # (the Compare page's default charts do not have it); it leads with the page's metric all the same
    report = build_report(uri, group=GROUP)
    assert K.RATIO_MAX in report.content.keys and set(KEYS) < set(report.content.keys)
    [mine] = [s for s in report.content.summaries if s.run_id == ids["mismatch"]]
    by_key = {d.key: d.lead for d in mine.departures}
    assert by_key[K.RATIO_MAX].lasting and by_key[K.RATIO_MAX].weight > by_key[K.RATIO_MEAN].weight, by_key
    assert mine.first.key == K.RATIO_MEAN
    assert _cell_rows(report.html) == expected
    assert _md_rows(report.markdown) == expected
    for name in ("mismatch", "burst"):
        key, when = expected[name][1].split(" ", 1)
        assert f"- {name}: {key.replace('_', chr(92) + '_')} leaves the reference band" in report.markdown
        assert when in report.markdown

    # the Compare page, its default metrics (KEYS, in its order): the table above its charts
    at = app(uri, monkeypatch, "compare")
    at.sidebar.multiselect(key="sidebar.reference").set_value(refs)
    at.sidebar.multiselect(key="sidebar.candidates").set_value(list(ids.values())).run()
    assert not at.exception, [e.value for e in at.exception]
    assert sorted(at.multiselect(key="compare.metrics").value) == sorted(KEYS)
    [table] = [m.value for m in at.html if "<th>departs</th>" in m.value]
    assert _cell_rows(table) == expected

    # the watcher: the event of each departing candidate's lead metric says the verdict and the same when
    _, events = watch_once(uri, divergence=True)
    texts = {name: [e["text"] for e in events if e["run_id"] == ids[name]] for name in ids}
    for name in ("mismatch", "burst"):
        key, when = expected[name][1].split(" ", 1)
        [event] = [e for e in events if e["run_id"] == ids[name] and e["kind"] == "divergence" and e["key"] == key]
        assert f" {STATUS_WORDS['diverged']} from its reference(s)" in event["text"], event["text"]
        assert f"{key} leaves the reference band" in event["text"] and f"{when} (" in event["text"], event["text"]
        assert (event["onset_step"], event["alert_step"]) == (leads[name].lead.onset_step, leads[name].lead.alert_step)
    assert any(STATUS_WORDS["nonfinite"] in t and f"at step {NAN_AT[0]}" in t for t in texts["nan"]), texts["nan"]
    assert texts["seed"] == []
