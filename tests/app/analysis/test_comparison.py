"""`rldiag.app.compare`: one comparison for every product, on real runs in a SQLite store: per candidate
its status, departures, evidence and likely causes; the all-clear only for complete, clean candidates;
the detector options it ran with; what to load from one function, and the report and the dashboard's
Build report (loaded as the page loads) saying the same."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from rldiag.app import CompareOptions, DivergenceConfig, compare, load_keys
from rldiag.app.analysis.config_diff import load_configs
from rldiag.app.data.histories import load_histories
from rldiag.app.data.store import open_store
from rldiag.app.report.build import build_report, render_report
from rldiag.collectors import keys as K
from tests.helpers.runs import write_run

N = 120
SHOWN = [K.RATIO_MEAN, K.LOSS, K.GRAD_NORM]


def _run(uri: str, name: str, seed: int, *, shift: float = 0.0, nan_from: int | None = None,
         unchecked: tuple[int, ...] = (), params: dict | None = None) -> str:
    rng = np.random.default_rng(seed)
    steps = []
    for s in range(N):
        bad = nan_from is not None and s >= nan_from
        steps.append((s, {K.RATIO_MEAN: 1.0 + 0.01 * rng.standard_normal() + (shift if s >= 60 else 0.0),
                          K.LOSS: 0.5 + 0.02 * rng.standard_normal(),
                          K.GRAD_NORM: math.nan if bad else 1.0 + 0.05 * rng.standard_normal(),
                          K.GRAD_FINITE: 0.0 if bad else 1.0, K.GRAD_FOUND: 0.0 if s in unchecked else 1.0}))
    return write_run(uri, experiment="cmp", name=name, steps=steps, params=params or {"batch_size": "4"})


@pytest.fixture(scope="module")
def runs(tmp_path_factory, template_db):
    import shutil

    path = tmp_path_factory.mktemp("cmp") / "m.db"
    shutil.copyfile(template_db, path)
    uri = f"sqlite:///{path}"
    ids = {"ref0": _run(uri, "ref0", 0), "ref1": _run(uri, "ref1", 1), "seed": _run(uri, "seed", 2),
           "shifted": _run(uri, "shifted", 3, shift=0.1), "nan": _run(uri, "nan", 4, nan_from=0),
           "unchecked": _run(uri, "unchecked", 5, unchecked=tuple(range(10, 20))),
           "lr": _run(uri, "lr", 6, shift=0.1, params={"batch_size": "4", "loop.lr": "0.01"})}
    store = open_store(uri)
    h = load_histories(store, list(ids.values()), list(load_keys(SHOWN)))
    params = {r: c.params for r, c in load_configs(store, list(ids.values())).items()}
    return uri, ids, h, params


def test_one_verdict_per_candidate(runs):
    _, ids, h, params = runs
    refs, cands = [ids["ref0"], ids["ref1"]], [ids[n] for n in ("seed", "shifted", "nan", "unchecked")]
    c = compare(h, refs, cands, CompareOptions(SHOWN), params=params)
    assert c.keys == tuple(SHOWN) and c.candidate_ids == tuple(cands) and c.options_text == "defaults"
    seed, shifted, nan, unchecked = c.verdicts
    assert seed.status == "within" and seed.clean
    assert shifted.status == "diverged" and [d.key for d in shifted.departures] == [K.RATIO_MEAN]
    assert abs(shifted.departures[0].onset_step - 60) <= 5 and not shifted.clean
    assert nan.status == "nonfinite" and nan.summary.nonfinite_steps[:2] == (0, 1)
    assert nan.causes.first.id == "padding_inf" and "batch_size=4 = 4 samples per step" in nan.causes.line()
    assert unchecked.summary.unchecked == tuple(range(10, 20)) and not unchecked.clean
    assert not c.all_clear and compare(h, refs, [ids["seed"]], CompareOptions(SHOWN), params=params).all_clear
    assert set(c.divergences) == set(SHOWN) and c.summaries[1] is shifted.summary


def test_the_detector_options_are_said():
    assert compare.__module__ == "rldiag.app.analysis.comparison"
    from rldiag.app.analysis.comparison import options_text

    assert options_text(DivergenceConfig()) == "defaults"
    assert options_text(DivergenceConfig(k=6.0, windows=(5, 9, 17))) == "k=6.0, windows=5,9,17"
    assert options_text(DivergenceConfig.from_options(["change_windows=5:9"])) == "change_windows=5:9"


def test_load_keys_is_the_one_list():
    got = load_keys(["grad_norm", K.RATIO_MEAN])  # an alias is read as its canonical key
    assert got[:2] == (K.GRAD_NORM, K.RATIO_MEAN) and len(got) == len(set(got))
    assert {K.GRAD_FOUND, K.GRAD_SCALER_OVERFLOW, K.GRAD_LOSS_SCALE, *K.WORST_TOKEN_KEYS, K.MISMATCH_LOGPROB_MEAN,
            K.BATCH_TOKENS, K.TRL_CLIPPED_RATIO} <= set(got)


def _body(markdown: str) -> str:
    return re.sub(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", "<time>", markdown)


def test_the_report_and_the_dashboards_build_report_say_the_same(runs):
    # the dashboard's Build report renders from the page's histories (page_keys); the CLI loads its own.
    # One list of keys: the same report, unchecked-gradient notes included (the page once missed grad/found)
    from rldiag.app.dashboard.compare import page_keys

    uri, ids, _, _ = runs
    refs, cands = [ids["ref0"], ids["ref1"]], [ids["unchecked"], ids["nan"]]
    cli = build_report(uri, reference=refs, candidates=cands, keys=SHOWN)
    store = open_store(uri)
    page = load_histories(store, refs + cands, list(page_keys(SHOWN)))
    dash = render_report(page, store, refs, cands, keys=SHOWN)
    assert "gradients not checked at 10 steps (10-19; grad/found 0)" in cli.markdown
    assert _body(dash.markdown) == _body(cli.markdown)
    assert "Detector options: defaults." in cli.markdown and "detector options: defaults" in cli.html


def test_the_one_line_rows_never_say_within_the_band_for_a_candidate_that_is_not_clean(runs):
    """The Compare page's and the experiments' table: a candidate with no departure but unchecked gradients
    is "not an all-clear", never "within the band"; the clean seed is."""
    from rldiag.app.analysis.verdicts import verdict_rows

    _, ids, h, params = runs
    refs, cands = [ids["ref0"], ids["ref1"]], [ids["seed"], ids["unchecked"]]
    c = compare(h, refs, cands, CompareOptions(SHOWN), params=params)
    rows = {r.run: r for r in verdict_rows(c, {ids["seed"]: "seed", ids["unchecked"]: "unchecked"})}
    assert c.verdicts[1].status == "within"  # the band test alone would say "within"
    assert rows["unchecked"].verdict == "no departure found, not an all-clear", rows["unchecked"]
    assert rows["seed"].verdict == "within the band" and rows["seed"].departs == "-"


def test_a_causes_evidence_says_alert_and_onset_as_every_product_does(runs):
    # a band departure cited by a likely cause reads as the report's and the watcher's lines: "alerted at
    # step A (started about step O)" of the metric's lead departure, never the onset alone
    from rldiag.app.analysis.verdicts import departure_sentence, when_text

    _, ids, h, params = runs
    (v,) = compare(h, [ids["ref0"], ids["ref1"]], [ids["lr"]], CompareOptions(SHOWN), params=params).verdicts
    (d,) = v.departures
    lead = d.lead
    assert v.causes.first.id == "optimizer" and v.causes.first.settings == ("loop.lr 0.01 vs (not set)",)
    cited = [t for t in v.causes.first.signature if t.startswith(K.RATIO_MEAN)]
    assert cited == [departure_sentence(K.RATIO_MEAN, lead)], cited
    assert when_text(lead.onset_step, lead.alert_step) in cited[0] and "(level, delta " in cited[0]
    assert lead.alert_step > lead.onset_step and "alerted at step" in cited[0], cited  # both steps said


def test_the_comparison_carries_the_band_each_diverged_candidate_was_tested_against(runs):
    # only diverged (candidate, metric) pairs with a level lead get a band; its trailing median leaves it at the
    # alert step, within the departure, with the verdicts' own detector options
    from rldiag.app.analysis.comparison import tested_bands

    _, ids, h, params = runs
    refs, cands = [ids["ref0"], ids["ref1"]], [ids["seed"], ids["shifted"], ids["nan"]]
    assert compare(h, refs, cands, CompareOptions(SHOWN), params=params).bands == {}  # kept only where asked
    c = compare(h, refs, cands, CompareOptions(SHOWN, bands=True), params=params)
    assert {k: set(b) for k, b in c.bands.items()} == {K.RATIO_MEAN: {ids["shifted"]}}  # nan's grad/norm: non-finite
    band, lead = c.bands[K.RATIO_MEAN][ids["shifted"]], c.divergences[K.RATIO_MEAN][ids["shifted"]].lead
    out = (band.candidate < band.lower) | (band.candidate > band.upper)
    assert int(band.steps[np.flatnonzero(out & (band.steps >= lead.onset_step))[0]]) == lead.alert_step
    assert band.window in DivergenceConfig().windows
    # a chart given only the divergences (the Compare page's figure) computes the same band
    again = tested_bands(h, K.RATIO_MEAN, refs, c.divergences[K.RATIO_MEAN], c.detector)
    assert set(again) == {ids["shifted"]} and np.array_equal(again[ids["shifted"]].upper, band.upper)
    wide = compare(h, refs, [ids["shifted"]], CompareOptions(SHOWN, DivergenceConfig(min_delta=0.02), bands=True), params=params)
    wider = wide.bands[K.RATIO_MEAN][ids["shifted"]]  # the options it ran with: the floor widens the band drawn
    assert np.nanmedian(wider.upper - wider.lower) > np.nanmedian(band.upper - band.lower) + 0.03
