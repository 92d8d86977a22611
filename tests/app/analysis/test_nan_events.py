"""NaN events: steps from the metrics of any run; parameters and tokens from rldiag's alerts."""

from __future__ import annotations

import math

from rldiag.app.analysis.nan_events import nan_events
from rldiag.app.data.alerts import load_alert_events
from rldiag.app.data.histories import load_histories
from rldiag.app.data.store import open_store
from rldiag.collectors import keys
from rldiag.experiments.example_loop import LoopConfig, run
from tests.helpers.runs import write_run


def test_rldiag_run_names_step_parameters_and_token(store_uri):
    # 2 rollouts x 2 optimizer steps: the NaN lands on the last one (under "warn" the weights turn NaN)
    res = run(LoopConfig(steps=2, nan_at=3, policy="warn", experiment="nan"), tracking_uri=store_uri, progress=False)
    h = load_histories(open_store(store_uri), [res.run_id], [keys.GRAD_FINITE, keys.GRAD_NORM])
    ev = nan_events(h, open_store(store_uri))
    assert ev["step"].tolist() == [3]  # the injected optimizer step, and only it
    row = ev.iloc[0]
    assert row.source == "alerts" and math.isnan(row.grad_norm)
    assert row.n_params >= 1 and "embed" in row.params  # the NaN flows back into the embedding
    assert "sample 1 token 3" in row.positions  # the injection point: logits[1, 3]


def test_foreign_run_gets_its_steps_from_grad_norm(store_uri):
    rid = write_run(store_uri, name="trl", steps=[(s, {"grad_norm": v}) for s, v in
                                                   enumerate([1.0, float("nan"), 2.0, float("inf")])])
    h = load_histories(open_store(store_uri), [rid], [keys.GRAD_FINITE, keys.GRAD_NORM])
    assert load_alert_events(open_store(store_uri), [rid]) == {rid: []}
    ev = nan_events(h, open_store(store_uri))
    assert ev["step"].tolist() == [1, 3]
    assert ev["source"].tolist() == ["metrics", "metrics"] and ev["params"].tolist() == ["", ""]
    assert math.isnan(ev.grad_norm[0]) and ev.grad_norm[1] == math.inf


def test_a_nan_finite_flag_is_a_bad_step_for_the_events_page_and_the_watcher(store_uri):
    # grad/finite NaN (a NaN flag, e.g. a reduction that went NaN) is no all-clear: the NaN events page
    # and the watcher share `bad_steps`, so both list step 2; the finite steps 0, 1, 3 are not listed.
    from rldiag.app.analysis.nan_events import bad_steps

    rid = write_run(store_uri, name="flagged", steps=[(s, {keys.GRAD_FINITE: v, keys.GRAD_NORM: 1.0})
                                                       for s, v in enumerate([1.0, 1.0, float("nan"), 1.0])])
    h = load_histories(open_store(store_uri), [rid], [keys.GRAD_FINITE, keys.GRAD_NORM])
    assert [b.step for b in bad_steps(h, rid)] == [2]
    assert nan_events(h, open_store(store_uri))["step"].tolist() == [2]
