"""Likely causes on real masked-vs-unmasked runs: the unmasked runs with batch x accumulation > 1 get the
`-inf` padding cause (NaN gradients from step 1, finite loss, the alert's origin in the loss's backward),
the 1x1 run and every masked run none."""

from __future__ import annotations

import pytest

from rldiag.app.analysis.causes import SIGNATURE_KEYS, likely_causes
from rldiag.app.analysis.config_diff import load_configs
from rldiag.app.data.alerts import load_alert_events
from rldiag.app.data.histories import load_histories
from rldiag.app.data.runs import find_runs
from rldiag.app.data.store import open_store
from rldiag.experiments import masked_vs_unmasked as mvu

STEPS = 4


@pytest.fixture(scope="module")
def judged(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mvu-causes")
    uri = f"sqlite:///{tmp / 'mlruns.db'}"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp)
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        mvu.run_experiment(mvu.ExperimentConfig(base=mvu.DistillConfig(steps=STEPS), experiment="mvu"),
                           tracking_uri=uri, progress=False)
    store = open_store(uri)
    runs = find_runs(store, group=mvu.GROUP)
    names = dict(zip(runs["run_id"], runs["name"]))
    ids = list(names)
    h = load_histories(store, ids, list(SIGNATURE_KEYS))
    configs, alerts = load_configs(store, ids), load_alert_events(store, ids)
    # every run judged against the masked runs (the fix); a masked run against the other masked ones
    masked = [r for r in ids if names[r].startswith("masked")]
    out = {}
    for r in ids:
        refs = [m for m in masked if m != r]
        (out[names[r]],) = likely_causes(h, configs, refs, [r], alerts=alerts)
    return out


@pytest.mark.parametrize("name", ["unmasked-b1xa2", "unmasked-b2xa1"])
def test_unmasked_with_more_than_one_sample_gets_the_padding_cause(judged, name):
    rc = judged[name]
    assert [c.id for c in rc.causes] == ["padding_inf"], rc.line()
    cause = rc.first
    assert cause.signature[0] == (f"non-finite gradients from step 1 (the first step), {STEPS} of {STEPS} steps, "
                                  "while the loss stays finite")
    assert "NaN entered from the loss's backward (the loss was finite)" in cause.signature[1]
    b, a = name.removeprefix("unmasked-b").split("xa")
    assert cause.settings == (f"batch_size={b} x accumulation={a} = 2 samples per step: ragged lengths get padded",)
    assert "variable completion length" in cause.source and not cause.hint  # cited by what it says
    print(f"\n{name}: {rc.line()}")


@pytest.mark.parametrize("name", ["unmasked-b1xa1", "masked-b1xa1", "masked-b1xa2", "masked-b2xa1"])
def test_the_others_get_no_cause(judged, name):
    assert judged[name].causes == (), judged[name].line()
