"""A headline leads with what lasts and is largest (issue 41, item 4): a burst that ended is listed as such
("came back after step E"), never first where a lasting departure exists; a departure's end is where the
candidate came back, and one that lasts to the end has none. Every product takes the lead from one place
(`CandidateSummary.first`), whatever order the metrics were asked in."""

from __future__ import annotations

import numpy as np
import pytest

from rldiag.app.analysis.divergence import compare_runs, detect_divergence, summarize
from rldiag.app.analysis.verdicts import departure_when, rows_of, when_text
from rldiag.app.data.histories import Histories
from rldiag.app.data.trace import Trace
from rldiag.collectors import keys as K

N = 300
REFS = ["r0", "r1", "r2"]


def _trace(run: str, key: str, values: np.ndarray) -> Trace:
    steps = np.arange(len(values), dtype=np.int64)
    return Trace(run, key, key, steps, np.asarray(values, float), steps)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_departure_ends_where_the_candidate_came_back_and_one_that_lasts_has_no_end(seed):
    rng = np.random.default_rng(seed)
    refs = [_trace(f"r{i}", K.LOSS, 1 + 0.05 * rng.standard_normal(N)) for i in range(3)]
    lasting = 1 + 0.05 * rng.standard_normal(N)
    lasting[150:] += 0.25  # 5 noise sd, to the end
    d = detect_divergence(refs, _trace("c", K.LOSS, lasting))
    assert [(x.kind, x.end_step) for x in d.departures] == [("level", None)], d.departures
    assert d.lead.lasting and departure_when(d.lead) == when_text(d.lead.onset_step, d.lead.alert_step)

    back = 1 + 0.05 * rng.standard_normal(N)
    back[100:160] += 0.25  # out at steps 100-159, back from 160
    d = detect_divergence(refs, _trace("c", K.LOSS, back))
    [dep] = d.departures
    # the detector's end waits for a window's median to be back inside (5 steps late on the 11-step
    # window); the end is the last step out
    assert 157 <= dep.end_step <= 161, dep
    assert abs(dep.onset_step - 100) <= 3 and 0.2 < dep.delta < 0.3, dep
    assert departure_when(dep).endswith(f", came back after step {dep.end_step}")


def _histories(rng: np.random.Generator) -> Histories:
    runs = {r: {K.LOSS: 1 + 0.05 * rng.standard_normal(N), K.ENTROPY: 2 + 0.05 * rng.standard_normal(N)} for r in REFS}
    cand = {K.LOSS: 1 + 0.05 * rng.standard_normal(N), K.ENTROPY: 2 + 0.05 * rng.standard_normal(N)}
    cand[K.ENTROPY][20:45] += 1.0  # a warm-up burst of 20 noise sd that ends: earlier and larger
    cand[K.LOSS][150:] += 0.4  # the real, lasting drift: 8 noise sd from step 150
    runs["cand"] = cand
    traces = {(r, k): _trace(r, k, v) for r, m in runs.items() for k, v in m.items()}
    return Histories("sqlite:///unused.db", "sql", traces, tuple(runs), {}, {}, {})


def test_a_lasting_drift_leads_a_burst_that_ended_in_every_product():
    from rldiag.app.dashboard.compare import glance_line, summary_line
    from rldiag.app.report.content import headline

    h = _histories(np.random.default_rng(0))
    leads = []
    for keys in ([K.ENTROPY, K.LOSS], [K.LOSS, K.ENTROPY]):  # the order asked in never changes the lead
        (s,) = summarize(compare_runs(h, REFS, ["cand"], keys), h, REFS, ["cand"], keys)
        assert [d.key for d in s.departures] == [K.ENTROPY, K.LOSS]  # by onset: the burst came first
        leads.append((s.first.key, s.first.lead))
    assert leads[0] == leads[1]
    burst = next(d for d in s.departures if d.key == K.ENTROPY).lead
    lead = s.first.lead
    assert s.first.key == K.LOSS and lead.lasting and not burst.lasting and burst.weight > lead.weight
    assert abs(lead.onset_step - 150) <= 3 and 40 <= burst.end_step <= 46, (lead, burst)

    when, came_back = departure_when(lead), departure_when(burst)
    assert "came back after step" in came_back and "came back" not in when
    line = headline(s, "cand")
    assert line.startswith(f"cand: {K.LOSS} leaves the reference band, {when} (level, "), line
    assert f"2 metrics in all; also {K.ENTROPY} {came_back}" in line
    page = summary_line(s, "cand").replace("\\", "")
    assert f"{K.LOSS} leaves the reference band, {when} (level, " in page and f"also {K.ENTROPY} {came_back}" in page
    assert f"{K.LOSS} {when}" in glance_line([s], {"cand": "cand"}, 3).replace("\\", "")
    [row] = rows_of([s], [], {"cand": "cand"})
    assert row.verdict == "departs" and row.departs == f"{K.LOSS} {when}"


def test_without_a_lasting_departure_the_largest_leads():
    rng = np.random.default_rng(1)
    runs = {r: {K.LOSS: 1 + 0.05 * rng.standard_normal(N), K.ENTROPY: 2 + 0.05 * rng.standard_normal(N)} for r in REFS}
    cand = {K.LOSS: 1 + 0.05 * rng.standard_normal(N), K.ENTROPY: 2 + 0.05 * rng.standard_normal(N)}
    cand[K.LOSS][30:70] += 0.35  # 7 sd, back at 70: first
    cand[K.ENTROPY][120:170] += 1.0  # 20 sd, back at 170: larger
    runs["cand"] = cand
    traces = {(r, k): _trace(r, k, v) for r, m in runs.items() for k, v in m.items()}
    h = Histories("sqlite:///unused.db", "sql", traces, tuple(runs), {}, {}, {})
    (s,) = summarize(compare_runs(h, REFS, ["cand"]), h, REFS, ["cand"])
    assert [d.key for d in s.ranked] == [K.ENTROPY, K.LOSS], s.departures
    assert all(not d.lead.lasting for d in s.ranked)


@pytest.mark.parametrize("shift, seed", [(1.5, 1), (1.5, 4), (2.0, 6)])
def test_a_small_shift_that_lasts_to_the_end_never_ends_early(shift, seed):
    # 1.5-2 noise sd from step 200 of 600, to the end: the detector's end rule (a window's median back under
    # half its bar) ended these at steps 506, 537 and 337 ("leaves the band ... to step 337", then a second
    # departure from step 340) while the candidate never came back
    rng = np.random.default_rng(100 + seed)
    refs = [_trace(f"r{i}", K.LOSS, 1 + 0.05 * rng.standard_normal(600)) for i in range(3)]
    c = 1 + 0.05 * rng.standard_normal(600)
    c[200:] += 0.05 * shift
    d = detect_divergence(refs, _trace("c", K.LOSS, c))
    [dep] = d.departures
    assert dep.kind == "level" and dep.lasting and 195 <= dep.onset_step <= 220, d.departures
    assert "came back" not in departure_when(dep)
