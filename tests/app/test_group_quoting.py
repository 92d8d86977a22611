"""`rldiag watch --divergence` compares every group, whatever quote characters its name holds: a name with
an apostrophe is quoted in the MLflow search filter, one with both quote characters is matched after a
search on the role alone; a group whose name only starts like another's never takes its references."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from rldiag.app.data.store import open_store
from rldiag.app.watch.loop import Watcher
from rldiag.app.watch.state import WatchState
from rldiag.collectors import keys
from rldiag.collectors.alerts import JsonlSink
from tests.helpers.runs import write_run


@pytest.mark.parametrize("group", ["bob's v0 vs v1", 'say "v1" \'now\''])
def test_a_group_with_quotes_in_its_name_is_compared(store_uri, tmp_path, group):
    rng = np.random.default_rng(0)
    for seed in range(2):
        noise = rng.normal(0, 0.01, 120)
        write_run(store_uri, name=f"ref{seed}", tags={keys.TAG_GROUP: group, keys.TAG_ROLE: "reference"},
                  steps=[(s, {keys.RATIO_MEAN: 1.0 + noise[s]}) for s in range(120)])
    # a reference of another group, far off: taking it would hide the departure
    write_run(store_uri, name="other", tags={keys.TAG_GROUP: group + " (old)", keys.TAG_ROLE: "reference"},
              steps=[(s, {keys.RATIO_MEAN: 1.1}) for s in range(120)])
    noise = rng.normal(0, 0.01, 120)
    cand = write_run(store_uri, name="cand", tags={keys.TAG_GROUP: group, keys.TAG_ROLE: "candidate"}, finish=False,
                     steps=[(s, {keys.RATIO_MEAN: 1.0 + noise[s] + (0.1 if s >= 60 else 0.0)}) for s in range(120)])
    alerts = tmp_path / "alerts.jsonl"
    w = Watcher(open_store(store_uri), WatchState(tmp_path / "s.json"), [JsonlSink(alerts, background=False)],
                divergence=True)
    assert w.poll().alerts == 1
    (e,) = [json.loads(line) for line in Path(alerts).read_text().splitlines()]
    assert e["kind"] == "divergence" and e["run_id"] == cand and e["key"] == keys.RATIO_MEAN
    assert len(e["references"]) == 2
    w.close()
