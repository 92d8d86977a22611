"""NaN events: steps from the metrics of any run; parameters and tokens from rldiag's alerts."""

from __future__ import annotations

import math

from rldiag.app.analysis.nan_events import load_alert_events, nan_events
from rldiag.app.data.histories import load_histories
from rldiag.collectors import keys
from rldiag.experiments.example_loop import LoopConfig, run

from tests.app.conftest import write_run


def test_rldiag_run_names_step_parameters_and_token(store_uri):
    # 2 rollouts x 2 optimizer steps: the NaN lands on the last one (under "warn" the weights turn NaN)
    res = run(LoopConfig(steps=2, nan_at=3, policy="warn", experiment="nan"), tracking_uri=store_uri, progress=False)
    h = load_histories(store_uri, [res.run_id], [keys.GRAD_FINITE, keys.GRAD_NORM])
    ev = nan_events(h, store_uri)
    assert ev["step"].tolist() == [3]  # the injected optimizer step, and only it
    row = ev.iloc[0]
    assert row.source == "alerts" and math.isnan(row.grad_norm)
    assert row.n_params >= 1 and "embed" in row.params  # the NaN flows back into the embedding
    assert "sample 1 token 3" in row.positions  # the injection point: logits[1, 3]


def test_foreign_run_gets_its_steps_from_grad_norm(store_uri):
    rid = write_run(store_uri, name="trl", steps=[(s, {"grad_norm": v}) for s, v in
                                                   enumerate([1.0, float("nan"), 2.0, float("inf")])])
    h = load_histories(store_uri, [rid], [keys.GRAD_FINITE, keys.GRAD_NORM])
    assert load_alert_events(store_uri, [rid]) == {rid: []}
    ev = nan_events(h, store_uri)
    assert ev["step"].tolist() == [1, 3]
    assert ev["source"].tolist() == ["metrics", "metrics"] and ev["params"].tolist() == ["", ""]
    assert math.isnan(ev.grad_norm[0]) and ev.grad_norm[1] == math.inf
