"""`rldiag watch` tells an ESS drop with a rising mismatch (kind "is_degenerate"): the real `Watcher` over a
real SQLite store, a running run written step by step through rldiag's writer, polled after each step."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

from rldiag.app.data.store import open_store
from rldiag.app.watch.is_events import KIND
from rldiag.app.watch.loop import Watcher
from rldiag.app.watch.state import WatchState
from rldiag.collectors import keys as K
from rldiag.collectors.alerts import JsonlSink as _JsonlSink
from tests.helpers.runs import write_run

JsonlSink = partial(_JsonlSink, background=False)  # as `rldiag watch` builds it


def read_events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def point(s: int, *, rises: bool = True) -> dict[str, float]:
    # ESS 0.96, down to 0.45 at steps 40-49 and from 70 on; the low-prob share 0.2% -> 4% with it (or flat)
    down = 40 <= s < 50 or s >= 70
    return {K.POLICY_ESS: 0.45 if down else 0.96, K.MISMATCH_LOW_PROB_SHARE: 0.04 if down and rises else 0.002,
            K.GRAD_NORM: 1.0, K.LOSS: 0.1}


def test_the_watcher_alerts_each_stretch_once_with_its_numbers(store_uri, tmp_path):
    run = write_run(store_uri, name="collapse", finish=False, steps=[(s, point(s)) for s in range(30)])
    calm = write_run(store_uri, name="drop-only", finish=False, steps=[(s, point(s, rises=False)) for s in range(80)])
    alerts, state = tmp_path / "alerts.jsonl", tmp_path / "state.json"
    w = Watcher(open_store(store_uri), WatchState.load(state), [JsonlSink(alerts)])
    told = {}
    for step in range(30, 80):
        write_run(store_uri, run_id=run, finish=False, steps=[(step, point(step))])
        if (n := w.poll().alerts):
            told[step] = n
    # 3 steps in a row make a stretch: known at step 42 (40, 41, 42) and 72, each once
    assert told == {42: 1, 72: 1}, told
    first, second = read_events(alerts)
    assert {e["kind"] for e in (first, second)} == {KIND} and {e["run_id"] for e in (first, second)} == {run}
    assert (first["step"], second["step"], first["last_step"]) == (40, 70, 42)  # told as soon as known
    assert (first["ess_before"], first["ess_after"], first["ess_key"]) == (0.96, 0.45, K.POLICY_ESS)
    assert first["rises"] == {K.MISMATCH_LOW_PROB_SHARE: {"before": 0.002, "after": 0.04}}
    assert first["text"].startswith("rldiag watch: importance weights degenerate in run collapse (" + run + ") in "
                                    "experiment 'exp' from step 40: policy/ess 0.96 -> 0.45 from step 40")
    w.close()
    # a restart on the same state file tells neither again; the ESS drop with no mismatch rise: never told
    w2 = Watcher(open_store(store_uri), WatchState.load(state), [JsonlSink(alerts)])
    assert w2.poll().alerts == 0 and len(read_events(alerts)) == 2
    assert calm not in {e["run_id"] for e in read_events(alerts)}
    assert json.loads(state.read_text())["runs"][run]["noted"][KIND] == [[40, 40], [70, 70]]
    assert calm not in json.loads(state.read_text())["runs"]  # no event, no entry
    w2.close()
