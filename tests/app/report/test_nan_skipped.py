"""A reader can tell a skipped NaN step from one that updated the weights: the run's policy decides it, the
collectors log it (grad/skipped, the alert's `skipped`), and the NaN episodes say it."""

from __future__ import annotations

import pytest

from rldiag.app.analysis.comparison import load_keys
from rldiag.app.analysis.nan_events import nan_events
from rldiag.app.data.alerts import load_alert_events
from rldiag.app.data.histories import load_histories
from rldiag.app.data.store import open_store
from rldiag.app.report.nan_episodes import nan_episodes
from rldiag.collectors import keys
from rldiag.experiments.example_loop import LoopConfig
from rldiag.experiments.example_loop import run as run_loop


@pytest.mark.parametrize(("policy", "said"), [("skip", "skipped: the weights did not change"),
                                              ("warn", "stepped on it: the weights took the non-finite update")])
def test_the_episode_says_whether_the_weights_changed(policy, said, store_uri):
    res = run_loop(LoopConfig(steps=3, nan_at=5, policy=policy, experiment=f"nan-{policy}"), tracking_uri=store_uri,
                   progress=False)
    store = open_store(store_uri)
    h = load_histories(store, [res.run_id], list(load_keys([keys.GRAD_NORM])))
    skipped = h.get(res.run_id, keys.GRAD_SKIPPED)
    assert skipped is not None and skipped.steps.tolist() == [5]  # logged at the bad step only (the last: "warn" leaves NaN weights)
    events = nan_events(h, store, [res.run_id], alerts=load_alert_events(store, [res.run_id]))
    assert events["step"].tolist() == [5] and events["skipped"].tolist() == [1.0 if policy == "skip" else 0.0]
    [episode] = nan_episodes(events, h, [res.run_id])
    assert episode.skipped_text == said
    assert store.client.get_run(res.run_id).data.params[keys.PARAM_NONFINITE_POLICY] == policy


def test_a_run_that_did_not_say_is_not_guessed():
    import pandas as pd

    from rldiag.app.report.nan_episodes import Episode

    rows = pd.DataFrame({"step": [3, 4], "grad_norm": [float("nan")] * 2, "params": ["", ""], "n_params": [None] * 2,
                         "positions": ["", ""], "source": ["metrics"] * 2, "skipped": [None, 1.0]})
    assert Episode("r", rows).skipped_text == "skipped: the weights did not change (said at 1 of 2 steps)"
    assert Episode("r", rows.assign(skipped=[None, None])).skipped_text == "-"


@pytest.mark.parametrize(("policy", "said"), [("skip", "; skipped: the weights did not change"),
                                              ("warn", "; policy warn: the optimizer stepped on it")])
def test_the_watcher_says_it_too(policy, said, store_uri):
    from rldiag.app.watch.loop import watch_once

    res = run_loop(LoopConfig(steps=3, nan_at=5, policy=policy, experiment=f"watch-{policy}"), tracking_uri=store_uri,
                   progress=False)
    _, events = watch_once(store_uri)
    [event] = [e for e in events if e["run_id"] == res.run_id and e.get("kind") == "nonfinite_grad"]
    assert event["step"] == 5 and said in event["text"], event["text"]
    assert event["skipped"] is (policy == "skip") and event["policy"] == policy
