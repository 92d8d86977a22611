"""The departure tables (issue 41): the report's (HTML and Markdown) and the Compare page's "Every departure" table
give each departure's alert step beside its onset, as every sentence does, and word a variance departure in
noise terms only: no level delta in its row (the delta column is "-"; its size says "noise x2.5"). A metric that
left the band twice (a burst that ended, then a lasting drift) gets a row per departure, the one the verdict
names first: the table once showed only the burst, while the verdict named the drift.

Real runs in a SQLite store through rldiag's writer: three reference seeds, a candidate whose clip rate shifts
from step 100 (a level departure), one whose reward noise grows from step 80 at the same level (variance), and
one whose reward bursts at steps 15-39 and drifts from step 150 to the end."""

from __future__ import annotations

import html
import math
import re

import numpy as np
import pytest

from rldiag.app.report.build import build_report
from rldiag.collectors import keys as K
from tests.helpers.runs import write_run

N = 200
GROUP = "tables"


def _series(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {K.CLIP_RATE: np.abs(0.01 * rng.standard_normal(N)), K.REWARD_MEAN: 0.5 + 0.1 * rng.standard_normal(N)}


def _write(uri: str, name: str, role: str, series: dict[str, np.ndarray]) -> str:
    steps = [(s, {k: float(v[s]) for k, v in series.items()}) for s in range(N)]
    return write_run(uri, experiment="tables", name=name, steps=steps, tags={K.TAG_GROUP: GROUP, K.TAG_ROLE: role})


@pytest.fixture
def runs(store_uri):
    refs = [_write(store_uri, f"ref{seed}", "reference", _series(seed)) for seed in range(3)]
    level = _series(10)
    level[K.CLIP_RATE][100:] += 0.3  # 30 noise sd from step 100 to the end
    noisy = _series(11)
    noisy[K.REWARD_MEAN][80:] = 0.5 + 0.3 * np.random.default_rng(5).standard_normal(N - 80)  # noise x3, same level
    twice = _series(12)
    twice[K.REWARD_MEAN][15:40] += 2.0  # a burst of 20 noise sd that ends ...
    twice[K.REWARD_MEAN][150:] += 0.8  # ... then a lasting drift of 8 noise sd, on the same metric
    return store_uri, refs, {"level": _write(store_uri, "level", "candidate", level),
                             "noisy": _write(store_uri, "noisy", "candidate", noisy),
                             "twice": _write(store_uri, "twice", "candidate", twice)}


def _md_table(markdown: str) -> dict[tuple[str, str], list[dict[str, str]]]:
    """{(candidate, metric): [{column: cell}, ...]} of the Markdown report's departure table, escapes undone."""
    lines = [line for line in markdown.splitlines() if line.startswith("| ")]
    [start] = [i for i, line in enumerate(lines) if "| onset step |" in line]
    head = [c.strip() for c in lines[start].strip("|").split("|")]
    out = {}
    for line in lines[start + 1:]:  # the separator row starts "|-", not "| "
        cells = [c.strip().replace("\\", "") for c in line.strip("|").split("|")]
        if len(cells) != len(head) or cells[0] == "candidate":
            break
        out.setdefault((cells[0], cells[1]), []).append(dict(zip(head, cells)))
    return out


def _html_table(markup: str) -> dict[tuple[str, str], list[dict[str, str]]]:
    """{(candidate, metric): [{column: cell}, ...]} of the HTML report's departure table (the "alert (onset)" one)."""
    [table] = [t for t in re.findall(r"<table>(.*?)</table>", markup, re.DOTALL) if "<th>alert (onset)</th>" in t]
    head = [html.unescape(h) for h in re.findall(r"<th[^>]*>(.*?)</th>", table)]
    out = {}
    for row in re.findall(r"<tr[^>]*>(.*?)</tr>", table.split("<tbody>", 1)[1], re.DOTALL):
        cells = [html.unescape(re.sub(r"<[^>]+>", "", c)).replace("\xa0", " ")
                 for c in re.findall(r"<td[^>]*>(.*?)</td>", row, re.DOTALL)]
        out.setdefault((cells[0], cells[1]), []).append(dict(zip(head, cells)))
    return out


def test_the_report_tables_give_the_alert_and_word_a_variance_departure_in_noise_terms(runs):
    uri, refs, ids = runs
    report = build_report(uri, group=GROUP)
    by_run = {s.run_id: s for s in report.summaries}
    level, noisy = by_run[ids["level"]].first, by_run[ids["noisy"]].first
    assert (level.key, level.kind, noisy.key, noisy.kind) == (K.CLIP_RATE, "level", K.REWARD_MEAN, "variance")
    assert math.isfinite(noisy.delta)  # the detector's row keeps the median's move: the tables must not show it

    md = _md_table(report.markdown)
    assert md[("noisy", K.REWARD_MEAN)][0]["delta"] == "-", md
    assert md[("noisy", K.REWARD_MEAN)][0]["size (vs reference)"].startswith("noise x"), md
    assert md[("level", K.CLIP_RATE)][0]["delta"] not in ("-", ""), md  # a level departure keeps its delta
    assert md[("level", K.CLIP_RATE)][0]["alert step"] == str(level.alert_step), md

    table = _html_table(report.html)
    assert table[("noisy", K.REWARD_MEAN)][0]["delta"] == "-", table
    assert table[("noisy", K.REWARD_MEAN)][0]["size (vs reference)"].startswith("noise x"), table
    assert table[("level", K.CLIP_RATE)][0]["delta"] not in ("-", ""), table
    assert table[("level", K.CLIP_RATE)][0]["alert (onset)"] == f"{level.alert_step} ({level.onset_step})", table


def test_the_pages_every_onset_table_gives_the_alert_and_no_variance_delta(runs, monkeypatch):
    from tests.helpers.dashboard import app

    uri, refs, ids = runs
    report = build_report(uri, group=GROUP)
    level = {s.run_id: s for s in report.summaries}[ids["level"]].first
    at = app(uri, monkeypatch, "compare")
    at.sidebar.selectbox(key="sidebar.group").set_value(GROUP).run()
    at.multiselect(key="compare.metrics").set_value([K.CLIP_RATE, K.REWARD_MEAN]).run()
    assert not at.exception, [e.value for e in at.exception]
    at.toggle(key="compare.divergence.all").set_value(True).run()
    table = at.dataframe[0].value.set_index(["candidate", "metric"])
    assert "alert_step" in table.columns, table.columns
    assert table.loc[("level", K.CLIP_RATE), "alert_step"] == level.alert_step
    assert table.loc[("level", K.CLIP_RATE), "onset_step"] == level.onset_step
    assert pd_missing(table.loc[("noisy", K.REWARD_MEAN), "delta"]), table
    assert str(table.loc[("noisy", K.REWARD_MEAN), "size"]).startswith("noise x"), table
    assert not pd_missing(table.loc[("level", K.CLIP_RATE), "delta"]), table


def _twice(report, ids):
    [d] = [d for s in report.summaries if s.run_id == ids["twice"] for d in s.departures if d.key == K.REWARD_MEAN]
    lead, burst = d.lead, d.departures[0]
    assert lead.lasting and burst.end_step is not None and burst.onset_step < 50 <= 140 < lead.onset_step, d
    return lead, burst


def test_a_metric_that_left_the_band_twice_gets_a_row_per_departure_the_verdicts_first(runs):
    uri, refs, ids = runs
    report = build_report(uri, group=GROUP)
    lead, burst = _twice(report, ids)
    # the verdict names the drift; the table gave only the burst (the metric's first departure)
    when = f"alerted at step {lead.alert_step} (started about step {lead.onset_step})"
    assert f"| twice | departs | {K.REWARD_MEAN} {when} |" in report.markdown.replace("\\", "")
    md = [(r["onset step"], r["alert step"], r["end step"])
          for r in _md_table(report.markdown)[("twice", K.REWARD_MEAN)]]
    assert md == [(str(lead.onset_step), str(lead.alert_step), "(to the end)"),
                  (str(burst.onset_step), str(burst.alert_step), str(burst.end_step))], md
    rows = [(r["alert (onset)"], r["end step"]) for r in _html_table(report.html)[("twice", K.REWARD_MEAN)]]
    assert rows == [(f"{lead.alert_step} ({lead.onset_step})", "(to the end)"),
                    (f"{burst.alert_step} ({burst.onset_step})", str(burst.end_step))], rows
    assert "Of 6 (candidate, metric) comparisons" in report.markdown  # still counted once per metric


def test_the_pages_table_gives_a_row_per_departure_the_verdicts_first(runs, monkeypatch):
    from tests.helpers.dashboard import app

    uri, refs, ids = runs
    lead, burst = _twice(build_report(uri, group=GROUP), ids)
    at = app(uri, monkeypatch, "compare")
    at.sidebar.selectbox(key="sidebar.group").set_value(GROUP).run()
    at.multiselect(key="compare.metrics").set_value([K.CLIP_RATE, K.REWARD_MEAN]).run()
    at.toggle(key="compare.divergence.all").set_value(True).run()
    table = at.dataframe[0].value
    mine = table[(table["candidate"] == "twice") & (table["metric"] == K.REWARD_MEAN)]
    got = [(r.onset_step, r.alert_step, None if pd_missing(r.end_step) else r.end_step) for r in mine.itertuples()]
    want = [(lead.onset_step, lead.alert_step, None), (burst.onset_step, burst.alert_step, burst.end_step)]
    assert got == want, got


def pd_missing(v) -> bool:
    import pandas as pd

    return v is None or bool(pd.isna(v))
