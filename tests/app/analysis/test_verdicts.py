"""One place for words (issue 41, `rldiag.app.analysis.verdicts`), each rule pinned on real comparisons:
no negative bound for a metric that cannot be negative, "parity" only of a run at parity, variance
departures in noise terms, equal seeds never "differ only in seed", the filtered loss named from its
first filtered step, sources cited by what they say, never by a path."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from rldiag.app.analysis import causes as C
from rldiag.app.analysis import verdicts as V
from rldiag.app.analysis.divergence import detect_divergence
from rldiag.app.data.histories import Histories
from rldiag.app.data.trace import Trace
from rldiag.app.report.content import departure_text
from rldiag.collectors import keys as K


def _h(runs: dict[str, dict[str, list[float]]]) -> Histories:
    traces = {}
    for run, metrics in runs.items():
        for key, v in metrics.items():
            steps = np.arange(len(v), dtype=np.int64)
            traces[(run, key)] = Trace(run, key, key, steps, np.asarray(v, float), steps)
    return Histories("sqlite:///unused.db", "sql", traces, tuple(runs), {}, {}, {})


@pytest.mark.parametrize("key", [K.CLIP_RATE, K.KL_NEW_OLD])
def test_no_negative_bound_for_a_metric_that_cannot_be_negative(key):
    # two reference seeds at 0 to 0.004; the candidate at 0.34 after a learning-rate change. The k3 KL new/old
    # (every alias of it is k3) read "policy/kl_new_old leaves ... (0.34 vs -0.004 to 0.006" before
    mm = [2e-7] * 8
    h = _h({"a": {key: [0.0, 0.002, 0.0, 0.001, 0.0, 0.002, 0.0, 0.001], K.MISMATCH_LOGPROB_MEAN: mm},
            "b": {key: [0.0, 0.0, 0.004, 0.0, 0.003, 0.0, 0.0, 0.002], K.MISMATCH_LOGPROB_MEAN: mm},
            "cand": {key: [0.0, 0.34, 0.35, 0.33, 0.34, 0.36, 0.35, 0.34], K.MISMATCH_LOGPROB_MEAN: mm}})
    configs = {"a": {"lr": "0.001", "seed": "0"}, "b": {"lr": "0.001", "seed": "1"}, "cand": {"lr": "0.01"}}
    (rc,) = C.likely_causes(h, configs, ["a", "b"], ["cand"])
    assert rc.first.id == "optimizer"
    [text] = [t for t in rc.first.signature if t.startswith(key)]
    assert re.search(r"\(0\.34 vs 0 to 0\.0\d+", text), text


def test_range_text_bounds():
    assert V.range_text(K.CLIP_RATE, 0.34, -0.02, 0.02) == "0.34 vs 0 to 0.02"
    assert V.range_text(K.POLICY_ESS, 0.5, -0.1, 0.9) == "0.5 vs 0 to 0.9"
    assert V.range_text(K.LOSS, 0.34, -0.02, 0.02) == "0.34 vs -0.02 to 0.02"  # a loss can be negative
    assert V.range_text(K.KL_NEW_OLD_K1, 0.3, -0.01, 0.01) == "0.3 vs -0.01 to 0.01"  # the k1 KL can be negative


def test_parity_only_of_a_run_at_parity():
    off = V.parity_text(0.498, 1e-4)
    assert off == "mismatch mean 0.498, not at parity (tolerance 1e-04)"
    assert V.parity_text(2e-7, 1e-4) == "at parity (mismatch mean 2e-07, within the 1e-04 tolerance)"
    assert V.parity_text(math.nan, 1e-4).endswith("not at parity (tolerance 1e-04)")
    # a cause's words for a run off parity never read as if it were at parity
    h = _h({"ref": {K.MISMATCH_LOGPROB_MEAN: [2e-7] * 3, K.RATIO_MEAN: [1.0] * 3},
            "cand": {K.MISMATCH_LOGPROB_MEAN: [0.498] * 3, K.RATIO_MEAN: [1.6] * 3}})
    (rc,) = C.likely_causes(h, {}, ["ref"], ["cand"])
    text = rc.line()
    assert "not at parity (tolerance 1e-04)" in text and "parity is below" not in text
    assert not re.search(r"(?<!not )at parity \(", text), text


def test_a_variance_departure_is_worded_in_noise_terms():
    # same level, the candidate's step-to-step noise 5x the references' from step 100
    rng = np.random.default_rng(0)
    steps = np.arange(300, dtype=np.int64)
    refs = [Trace(r, K.LOSS, K.LOSS, steps, 0.6 + 0.01 * rng.standard_normal(300), steps) for r in ("a", "b")]
    noise = np.where(steps >= 100, 0.05, 0.01) * rng.standard_normal(300)
    d = detect_divergence(refs, Trace("c", K.LOSS, K.LOSS, steps, 0.6 + noise, steps))
    assert d.kind == "variance", d
    row = {"key": K.LOSS, "onset_step": d.onset_step, "end_step": d.end_step, "kind": d.kind, "delta": d.delta,
           "delta_sigma": d.delta_sigma, "candidate_level": d.candidate_level, "reference_level": d.reference_level,
           "size": d.size}
    text = departure_text(row)
    assert "noise x" in text and "delta" not in text and "%" not in text, text


def test_equal_seeds_never_differ_only_in_seed():
    assert V.same_params_note({"seed": "7", "lr": "1"}, [{"seed": "0", "lr": "1"}]) == (
        "its params differ from the references' only in seed")
    assert V.same_params_note({"loop.seed": "0"}, [{"loop.seed": "0"}, {"loop.seed": "1"}]).startswith(
        "its params equal a reference's, seed 0 included")
    # an engine seed the same in every run does not hide the loop seeds that differ (the engine-parity runs)
    assert V.same_params_note({"engine.seed": "0", "loop.seed": "1"}, [{"engine.seed": "0", "loop.seed": "0"}]) == (
        "its params differ from the references' only in seed")
    assert V.same_params_note({"lr": "1"}, [{"lr": "1", "seed": "0"}]) == (
        "its params equal the references' (it logged no seed)")
    h = _h({"ref": {K.LOSS: [0.5] * 4}, "cand": {K.LOSS: [0.5] * 4}})
    (rc,) = C.likely_causes(h, {"ref": {"seed": "3"}, "cand": {"seed": "3"}}, ["ref"], ["cand"])
    assert "only in seed" not in rc.line() and "seed 3 included" in rc.line()


def test_the_filtered_loss_is_named_from_its_first_filtered_step():
    # grad norm NaN from step 4; the trainer logs the loss NaN at step 4, then filtered to 0.0 from step 5
    nan = math.nan
    h = _h({"ref": {"grad/norm": [1.0] * 8, K.LOSS: [0.5] * 8},
            "cand": {"grad/norm": [1.0] * 4 + [nan] * 4, K.LOSS: [0.5] * 4 + [nan, 0.0, 0.0, 0.0]}})
    (rc,) = C.likely_causes(h, {}, ["ref"], ["cand"])
    assert rc.first.id == "nan_filter"
    assert "the logged loss is not the real one from step 5" in rc.first.fix, rc.first.fix


def test_sources_are_cited_by_their_content_never_by_a_path():
    for text in (C.SEED_PIPELINERL, C.SEED_TRL, V.SOURCE_PIPELINERL, V.SOURCE_TRL):
        assert "shared/" not in text and ".txt" not in text and "seeds/" not in text, text
    assert "processed_logprobs" in V.SOURCE_PIPELINERL and "fp32 lm_head" in V.SOURCE_PIPELINERL
    assert "variable completion length" in V.SOURCE_TRL


def test_when_text_says_alert_and_onset_one_way():
    from rldiag.app.analysis.verdicts import when_text
    assert when_text(3, 8) == "alerted at step 8 (started about step 3)"
    assert when_text(5, 5) == "at step 5"
    assert when_text(5, None) == "at step 5"


def test_no_smallest_shift_is_told_for_a_0_1_flag():
    # a report read "a lasting shift under 2.98e-07 on grad/finite would not show": any change of a flag shows
    from rldiag.app.analysis.divergence import Divergence, detectable_text

    def within(key: str) -> Divergence:
        return Divergence(key, None, None, None, math.nan, math.nan, None, 100, detectable=2.98e-7)

    flag, metric = within(K.GRAD_FINITE), within(K.LOSS)
    assert flag.evidence == "within the band" and "would not show" in metric.evidence
    assert detectable_text([flag, metric]) == f"a lasting shift under 2.98e-07 on {K.LOSS} would not show"
    assert detectable_text([within(K.GRAD_FOUND), within(K.GRAD_SKIPPED)]) == ""
