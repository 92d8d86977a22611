"""NaN gradient events grouped into episodes: one per run and stretch of bad steps, ended by a logged
finite step (so a trainer logging every 10th step keeps one episode), said in one line each."""

from __future__ import annotations

import math

from rldiag.app.analysis.nan_events import nan_events
from rldiag.app.data.histories import load_histories
from rldiag.app.data.store import open_store
from rldiag.app.report.nan_episodes import nan_episodes
from rldiag.collectors import keys
from tests.helpers.runs import write_run

NAN = math.nan


def _run(uri: str, name: str, norms: dict[int, float]) -> str:
    return write_run(uri, experiment="ep", name=name, steps=[
        (s, {keys.GRAD_NORM: v, keys.GRAD_FINITE: float(math.isfinite(v))}) for s, v in norms.items()])


def test_episodes_end_at_a_logged_finite_step_not_at_a_gap_in_the_step_numbers(store_uri):
    # every10 logs steps 10..50: NaN at 10, 20, 30, finite at 40, inf at 50 -> episodes [10, 20, 30] and [50]
    # dense logs every step 1..6: NaN at 1, 2, 3 and 5, finite at 4 and 6 -> episodes [1-3] and [5]
    every10 = _run(store_uri, "every10", {10: NAN, 20: NAN, 30: NAN, 40: 1.0, 50: math.inf})
    dense = _run(store_uri, "dense", {1: NAN, 2: NAN, 3: NAN, 4: 1.0, 5: NAN, 6: 1.0})
    store = open_store(store_uri)
    h = load_histories(store, [every10, dense], [keys.GRAD_NORM, keys.GRAD_FINITE])
    events = nan_events(h, store, [every10, dense])
    episodes = nan_episodes(events, h, [every10, dense])
    assert [(ep.run_id, ep.steps) for ep in episodes] == [
        (every10, [10, 20, 30]), (every10, [50]), (dense, [1, 2, 3]), (dense, [5])]
    first, inf_step = episodes[0], episodes[1]
    assert (first.steps_label, first.norm_text, inf_step.steps_label, inf_step.norm_text) == (
        "steps 10, 20, 30", "NaN", "step 50", "inf")
    # metrics only, no rldiag alert: the parameters are unknown and said so, never "0 parameter tensors"
    assert first.params_text == "not named (no rldiag alert for these steps)" and first.positions_text == "-"
    # without the histories only the step numbers tell: 10, 20 and 30 are then three episodes
    assert [ep.steps for ep in nan_episodes(events, None, [every10])] == [[10], [20], [30], [50]]
