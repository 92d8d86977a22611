"""Divergence onsets on the engine-parity experiment's own runs (real vLLM, the session's parity store):
each departure starts where the experiment says it does, and seeds of the reference never depart.

What the runs are (experiments/engine_parity.py): step 0 samples with the weights both sides share;
every later step follows a weight update. The prefix cache kept across updates is at exact parity at
step 0 (nothing cached yet) and reuses stale KV from step 1 on; raw logprobs differ from the trainer's
processed ones from step 0.
"""

from __future__ import annotations

import pytest

from rldiag.app.analysis.divergence import compare_runs
from rldiag.app.data.histories import load_histories
from rldiag.app.data.store import open_store
from rldiag.collectors import keys
from rldiag.experiments.engine_parity import REFERENCE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

METRICS = [keys.RATIO_MEAN, keys.MISMATCH_LOGPROB_MEAN, keys.MISMATCH_LOGPROB_MAX, keys.KL_NEW_OLD, keys.ENTROPY,
           keys.REWARD_MEAN, keys.LOSS, keys.CLIP_RATE]


def _compare(parity_store, refs: list[str], cands: list[str]):
    h = load_histories(open_store(parity_store.uri), [*refs, *cands], METRICS)
    return compare_runs(h, refs, cands, METRICS)


def _refs(parity_store) -> list[str]:
    return [parity_store.run_id(REFERENCE, s) for s in range(3)]


def test_prefix_cache_kept_across_updates_leaves_at_step_1_not_0(parity_store):
    cand = parity_store.run_id("prefix-cache-no-reset")
    found = _compare(parity_store, _refs(parity_store), [cand])
    mismatch = found[keys.MISMATCH_LOGPROB_MEAN][cand]
    assert mismatch.diverged and mismatch.kind == "level" and mismatch.onset_step == 1, mismatch.departures
    assert mismatch.first.candidate > 10 * mismatch.first.reference  # stale KV: far above float noise
    # no metric is said to leave at step 0, where the engine is at exact parity
    onsets = {k: d.onset_step for k, by in found.items() for d in by.values() if d.diverged}
    assert onsets and min(onsets.values()) >= 1, onsets


def test_raw_logprobs_leave_at_step_0_before_any_update(parity_store):
    cand = parity_store.run_id("raw-logprobs")
    d = _compare(parity_store, _refs(parity_store), [cand])[keys.RATIO_MEAN][cand]
    assert d.diverged and d.onset_step == 0 and d.kind == "level", d.departures


def test_the_reset_control_and_reference_seeds_never_depart(parity_store):
    # against the three seeds: the control with the cache reset on every update
    control = parity_store.run_id("prefix-cache-reset")
    found = _compare(parity_store, _refs(parity_store), [control])
    assert {k: d.departures for k, by in found.items() for d in by.values() if d.diverged} == {}
    # a single reference run (seed 0) and its other seeds as candidates: no false marker, at step 0 or later
    one, others = parity_store.run_id(REFERENCE, 0), [parity_store.run_id(REFERENCE, s) for s in (1, 2)]
    found = _compare(parity_store, [one], others)
    assert {(k, c): d.departures for k, by in found.items() for c, d in by.items() if d.diverged} == {}
