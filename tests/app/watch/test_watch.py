"""`rldiag watch` against real MLflow stores and real writers in other processes.

In-process (a `Watcher` over a SQLite store, points written through MLflow's own batch call as a
foreign trainer writes them): every grad-norm alias, inf stored as max-float, rldiag's grad/finite
flag, incremental reads, no repeat after a restart from the state file, runs that end between polls,
divergence. Out of process: `rldiag demo` (rldiag's collectors) and a transformers `Trainer` with
report_to="mlflow" (no rldiag at all) caught within two poll intervals; a watcher stopped mid-run
and restarted on the same state file (no repeat, no miss); a real `mlflow server` killed and
restarted under a running watcher.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from mlflow import MlflowClient

from rldiag.app.analysis.verdicts import when_text
from rldiag.app.cli.main import main as cli_main
from rldiag.app.data.steps import steps_to_ranges
from rldiag.app.data.store import open_store
from rldiag.app.watch.loop import Watcher
from rldiag.app.watch.state import RunState, WatchState, in_ranges
from rldiag.collectors import keys
from rldiag.collectors.alerts import JsonlSink as _JsonlSink
from tests.helpers.net import free_port
from tests.helpers.runs import log_raw, write_run

JsonlSink = partial(_JsonlSink, background=False)  # as `rldiag watch` builds it: written before the state is saved

RLDIAG = str(Path(sys.executable).parent / "rldiag")
MAX_FLOAT = 1.7976931348623157e308
NAN, INF = float("nan"), float("inf")


def read_events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def steps_of(events: list[dict], run_id: str | None = None) -> list[int]:
    return [e["step"] for e in events if e["kind"] == "nonfinite_grad" and (run_id is None or e["run_id"] == run_id)]


def running_run(uri: str, name: str, experiment: str = "exp", tags: dict | None = None) -> str:
    return write_run(uri, experiment=experiment, name=name, tags=tags, finish=False)


# ---- pure parts ------------------------------------------------------------------------------------
def test_ranges_and_new_steps():
    assert steps_to_ranges([7, 1, 2, 3, 3]) == [[1, 3], [7, 7]]
    assert in_ranges(np.array([0, 1, 3, 4, 7, 8]), [[1, 3], [7, 7]]).tolist() == [False, True, True, False, True, False]
    rs = RunState()
    for s in (5, 3, 4, 9):
        rs.mark(s)
    assert rs.alerted == [[3, 5], [9, 9]] and rs.alerts == 4 and rs.first_step == 3
    assert rs.new_steps(np.array([9, 2, 3, 6, 6])).tolist() == [2, 6]


# ---- one process, a SQLite store ---------------------------------------------------------------------
def test_a_first_poll_of_many_new_departures_sends_the_last_few_and_the_lead():
    from rldiag.app.analysis.divergence import Departure
    from rldiag.app.watch.loop import MAX_DEPARTURES_PER_POLL, _to_send

    def dep(onset: int, sd: float, lasting: bool = False) -> Departure:
        return Departure("level", onset, onset + 3, None if lasting else onset + 9, 1.0, 1.0, 0.1, sd)

    bursts = [dep(100 * i, 6.0 + (i == 2) * 20) for i in range(8)]
    assert _to_send(bursts[:3], bursts[2], "r", "k") == bursts[:3]
    sent = _to_send(bursts, bursts[2], "r", "k")  # the largest, then the latest
    assert len(sent) == MAX_DEPARTURES_PER_POLL and sent == [bursts[2], *bursts[-2:]]
    lasting = [*bursts[:7], dep(900, 6.0, lasting=True)]
    assert _to_send(lasting, lasting[-1], "r", "k") == lasting[-3:]
    rs = RunState()
    rs.tell_departure("k", 100, 103)
    assert rs.told_departure("k", 98, None) and rs.told_departure("k", 103, 110)
    assert not rs.told_departure("k", 104, 120)
    assert not rs.told_departure("k", 90, 99) and not rs.told_departure("other", 100, None) and not rs.legacy("k")


def test_every_grad_norm_name_maxfloat_and_flag_incremental_and_restart(store_uri, tmp_path):
    trl = running_run(store_uri, "trl")
    verl = running_run(store_uri, "verl")
    ours = running_run(store_uri, "rldiag")
    fine = running_run(store_uri, "fine")
    t = 1_700_000_000_000
    log_raw(store_uri, trl, [("grad_norm", 1.0, t + 1, 1), ("grad_norm", NAN, t + 2, 2), ("loss", NAN, t + 3, 3)])
    log_raw(store_uri, verl, [("actor/grad_norm", 0.5, t + 1, 1), ("actor/grad_norm", INF, t + 3, 3)])
    log_raw(store_uri, ours, [(keys.GRAD_NORM, 2.0, t + 4, 4), (keys.GRAD_FINITE, 0.0, t + 4, 4),
                              (keys.GRAD_FINITE, 1.0, t + 5, 5)])
    log_raw(store_uri, fine, [("grad_norm", 1e300, t + 1, 1), ("train/grad_norm", 3.0, t + 2, 2)])
    client = MlflowClient(store_uri)
    # MLflow really stores inf as max-float: the watcher must read that back as inf
    assert client.get_metric_history(verl, "actor/grad_norm")[-1].value == MAX_FLOAT

    state_file, alerts = tmp_path / "state.json", tmp_path / "alerts.jsonl"
    store = open_store(store_uri)
    w = Watcher(store, WatchState.load(state_file), [JsonlSink(alerts)])
    res = w.poll()
    ev = [e for e in read_events(alerts) if e["kind"] == "nonfinite_grad"]
    # trl: NaN at 2; verl: inf at 3; rldiag: flag 0 at 4; fine: none
    assert sorted((e["run_name"], e["step"]) for e in ev) == [("rldiag", 4), ("trl", 2), ("verl", 3)]
    # trl's NaN loss at 3 is no gradient key: an alert of its own kind, with no gradient check logged there
    [loss] = [e for e in read_events(alerts) if e["kind"] == "nonfinite_loss"]
    assert (loss["run_name"], loss["step"], loss["loss"], loss["grads_checked"]) == ("trl", 3, "nan", False)
    by = {e["run_name"]: e for e in ev}
    assert by["verl"]["grad_norm"] == "inf" and by["verl"]["keys"] == {"actor/grad_norm": "inf"}
    assert by["trl"]["grad_norm"] == "nan" and by["rldiag"]["keys"] == {keys.GRAD_FINITE: 0.0}
    assert by["rldiag"]["grad_norm"] == 2.0 and all(e["source"] == "watch" for e in ev)
    assert res.runs == 4 and res.alerts == 4

    assert w.poll().alerts == 0 and w.poll().fetched == 0  # nothing new: nothing sent, nothing read
    log_raw(store_uri, trl, [("grad_norm", NAN, t + 6, 6), ("grad_norm", 1.0, t + 7, 7)])
    res = w.poll()
    assert res.alerts == 1 and res.fetched == 2  # only the two new rows were read
    assert steps_of(read_events(alerts), trl) == [2, 6]

    # a point logged, then the run ended, all between two polls: read once more after it ended
    log_raw(store_uri, verl, [("actor/grad_norm", NAN, t + 8, 8)])
    client.set_terminated(verl)
    assert w.poll().alerts == 1 and steps_of(read_events(alerts), verl) == [3, 8]
    w.close()

    # a new watcher on the same state file: everything is read again, nothing repeated
    saved = json.loads(state_file.read_text())
    assert saved["runs"][trl]["alerted"] == [[2, 2], [6, 6]] and saved["runs"][verl]["alerted"] == [[3, 3], [8, 8]]
    log_raw(store_uri, ours, [(keys.GRAD_FINITE, 0.0, t + 9, 9)])  # logged while no watcher ran
    w2 = Watcher(open_store(store_uri), WatchState.load(state_file), [JsonlSink(alerts)])
    assert w2.poll().alerts == 1
    assert sorted(steps_of(read_events(alerts))) == [2, 3, 4, 6, 8, 9]  # each once


def test_divergence_alerts_once_per_metric(store_uri, tmp_path):
    rng = np.random.default_rng(0)
    group = {keys.TAG_GROUP: "v0_vs_v1"}
    for seed in range(2):
        noise = rng.normal(0, 0.01, 120)
        write_run(store_uri, name=f"ref{seed}", tags={**group, keys.TAG_ROLE: "reference"},
                  steps=[(s, {keys.RATIO_MEAN: 1.0 + noise[s]}) for s in range(120)])
    noise = rng.normal(0, 0.01, 120)
    # the candidate's ratio mean leaves 1.0 at step 60 (by 10 sigma), as a mismatched engine makes it
    cand = write_run(store_uri, name="cand", tags={**group, keys.TAG_ROLE: "candidate"}, finish=False,
                     steps=[(s, {keys.RATIO_MEAN: 1.0 + noise[s] + (0.1 if s >= 60 else 0.0)}) for s in range(120)])
    alerts = tmp_path / "alerts.jsonl"
    w = Watcher(open_store(store_uri), WatchState(tmp_path / "s.json"), [JsonlSink(alerts)], divergence=True)
    assert w.poll().alerts == 1
    (e,) = read_events(alerts)
    assert e["kind"] == "divergence" and e["run_id"] == cand and e["key"] == keys.RATIO_MEAN
    assert abs(e["step"] - 60) <= 2 and e["departure"] == "level" and len(e["references"]) == 2
    # alert and onset, both, in the report's and the Compare page's words; "step" stays the onset
    assert e["onset_step"] == e["step"] and e["alert_step"] >= e["step"] and e["end_step"] is None
    when = when_text(e["onset_step"], e["alert_step"])
    assert f"departs from its reference(s) in group 'v0_vs_v1': {keys.RATIO_MEAN} leaves the reference band" in e["text"]
    assert f"{when} (level, delta 0.1" in e["text"], e["text"]
    assert w.poll().alerts == 0  # once per (run, metric)


def test_divergence_alert_comes_within_a_few_steps_on_a_running_run(store_uri, tmp_path):
    """Online: the watcher polls after every step of a RUNNING candidate; a 5-sd shift of its ratio
    mean from step 80 is alerted within 8 steps of it (the detector's 11-step windows need 6 shifted
    points), never before it."""
    rng = np.random.default_rng(1)
    group = {keys.TAG_GROUP: "live"}
    for seed in range(3):
        noise = rng.normal(0, 0.01, 200)
        write_run(store_uri, name=f"ref{seed}", tags={**group, keys.TAG_ROLE: "reference"},
                  steps=[(s, {keys.RATIO_MEAN: 1.0 + noise[s]}) for s in range(200)])
    noise = rng.normal(0, 0.01, 200)
    values = 1.0 + noise + np.where(np.arange(200) >= 80, 0.05, 0.0)
    cand = write_run(store_uri, name="cand", tags={**group, keys.TAG_ROLE: "candidate"}, finish=False,
                     steps=[(s, {keys.RATIO_MEAN: float(values[s])}) for s in range(60)])
    alerts = tmp_path / "alerts.jsonl"
    w = Watcher(open_store(store_uri), WatchState(tmp_path / "s.json"), [JsonlSink(alerts)], divergence=True)
    first = None
    for step in range(60, 120):
        write_run(store_uri, run_id=cand, finish=False, steps=[(step, {keys.RATIO_MEAN: float(values[step])})])
        if w.poll().alerts:
            first = step
            break
    assert first is not None and 80 <= first <= 88, first  # known at most 8 steps after the shift
    (e,) = read_events(alerts)
    assert e["run_id"] == cand and e["key"] == keys.RATIO_MEAN and abs(e["step"] - 80) <= 2
    assert e["alert_step"] == first and when_text(e["onset_step"], first) in e["text"], e  # alerted at the step it came


def test_bad_input_is_one_line_and_exit_2(store_uri, tmp_path, capsys):
    running_run(store_uri, "r", experiment="grpo")
    cases = [
        (["--experiment", "nope"], ["'nope'", "grpo", "--experiment"]),
        (["--interval", "-1"], ["'-1'", "--interval 30"]),
        (["--interval", "soon"], ["'soon'"]),
        (["--tracking-uri", f"http://127.0.0.1:{free_port()}"], ["127.0.0.1", "mlflow server"]),
        (["--tracking-uri", f"sqlite:///{tmp_path / 'missing.db'}"], ["missing.db", "does not exist"]),
        (["--webhook", "ftp://hooks.example/T0/SECRET"], ["http", "ftp://hooks.example/..."]),
    ]
    for extra, words in cases:
        args = ["watch", "--once", "--state", str(tmp_path / "s.json")] + (
            extra if "--tracking-uri" in extra else ["--tracking-uri", store_uri, *extra])
        assert cli_main(args) == 2, extra
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert all(w in err for w in words), (extra, err)
        assert "SECRET" not in err
    assert cli_main(["watch", "--once", "--tracking-uri", store_uri, "--experiment", "grpo",
                     "--state", str(tmp_path / "s.json")]) == 0


# ---- other processes ----------------------------------------------------------------------------------
class WatchProc:
    """`rldiag watch` in its own process; its log goes to a file the test reads."""

    def __init__(self, uri: str, cwd: Path, *extra: str, interval: float, name: str = "watch"):
        self.log = cwd / f"{name}.log"
        self.jsonl = cwd / f"{name}.jsonl"
        env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen([RLDIAG, "watch", "--tracking-uri", uri, "--interval", str(interval),
                                          "--state", str(cwd / "state.json"), "--jsonl", str(self.jsonl), *extra],
                                         cwd=cwd, stdout=f, stderr=subprocess.STDOUT, env=env)

    def text(self) -> str:
        return self.log.read_text()

    def events(self) -> list[dict]:
        return read_events(self.jsonl)

    def wait_for(self, cond, timeout: float, what: str):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if (got := cond()):
                return got
            assert self.proc.poll() is None, f"watcher exited: {self.text()}"
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}; watcher log:\n{self.text()}")

    def polled(self, timeout: float = 300) -> None:
        """Wait until the first cycle is done (the state file is written after each cycle)."""
        self.wait_for(lambda: (self.log.parent / "state.json").exists(), timeout, "the first poll")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)


def nonfinite_points(uri: str, run_id: str, key: str) -> dict[int, int]:
    """step -> timestamp (ms) of the run's NaN/inf/max-float points of `key`."""
    return {m.step: m.timestamp for m in MlflowClient(uri).get_metric_history(run_id, key)
            if not math.isfinite(m.value) or abs(m.value) == MAX_FLOAT}


def latency(event: dict, points: dict[int, int]) -> float:
    return event["time"] - points[event["step"]] / 1000


def test_rldiag_demo_in_another_process_is_caught_within_two_intervals(store_uri, tmp_path):
    interval = 3.0
    w = WatchProc(store_uri, tmp_path, interval=interval)
    try:
        w.polled()
        env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
        demo = subprocess.run([RLDIAG, "demo", "--nan-at", "3", "--steps", "6", "--policy", "skip",
                               "--tracking-uri", store_uri], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)
        assert demo.returncode == 0, demo.stderr
        run_id = demo.stdout.split()[1]
        (ev,) = w.wait_for(w.events, 3 * interval + 30, "the alert")
    finally:
        assert w.stop() == 0
    points = nonfinite_points(store_uri, run_id, keys.GRAD_NORM)
    assert list(points) == [3] and ev["step"] == 3 and ev["run_id"] == run_id
    assert ev["keys"] == {keys.GRAD_NORM: "nan", keys.GRAD_FINITE: 0.0}
    # logged at the point's timestamp; the writer sends within 1 s; then at most two intervals
    lag = latency(ev, points)
    print(f"demo: alert {lag:.1f} s after the NaN step was logged (interval {interval:g} s)")
    assert lag <= 2 * interval + 1.5
    assert "polling" in w.text() and "non-finite gradients" in w.text() and "Traceback" not in w.text()


HF_SCRIPT = textwrap.dedent("""
    import sys, time, torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    nan_at, steps, pause = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    V = 64

    class NanAt(Trainer):
        # finite forward, NaN backward (d sqrt(x)/dx at 0 is inf, times 0): grad_norm is NaN at `nan_at`,
        # then the NaN update ruins the weights and every later step is NaN too
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if self.state.global_step + 1 == nan_at:
                w = model.lm_head.weight
                loss = loss + 0.0 * ((w - w.detach()) ** 2).sum().sqrt()
            return loss

    class Pace(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            time.sleep(pause)

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=1)
    ids = torch.randint(2, V, (64, 12), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": r, "labels": r.clone()} for r in ids]
    args = TrainingArguments(output_dir="out", report_to="mlflow", run_name="hf-nan", save_strategy="no",
                             use_cpu=True, disable_tqdm=True, logging_steps=1, max_steps=steps,
                             per_device_train_batch_size=2, max_grad_norm=1.0, learning_rate=1e-3)
    NanAt(model=LlamaForCausalLM(cfg), args=args, train_dataset=data, callbacks=[Pace()]).train()
""")


def test_transformers_run_and_a_watcher_restarted_mid_run(store_uri, tmp_path):
    """A plain Trainer logging grad_norm through transformers' own MLflow callback; the watcher is
    stopped after its first alerts and a new one starts on the same state file while NaN steps keep
    coming: together they alert on every NaN step exactly once."""
    interval, nan_at, steps = 1.0, 3, 16
    script = tmp_path / "hf_nan.py"
    script.write_text(HF_SCRIPT)
    env = {**os.environ, "MLFLOW_TRACKING_URI": store_uri, "MLFLOW_EXPERIMENT_NAME": "hf",
           "MLFLOW_DISABLE_TELEMETRY": "true"}
    first = WatchProc(store_uri, tmp_path, "--tag-runs", interval=interval, name="first")
    first.polled()
    trainer = subprocess.Popen([sys.executable, str(script), str(nan_at), str(steps), "0.3"], cwd=tmp_path, env=env,
                               stdout=subprocess.DEVNULL, stderr=open(tmp_path / "hf.log", "wb"))
    second = None
    try:
        first.wait_for(first.events, 240, "the first alert")
        assert first.stop() == 0  # SIGTERM: finishes its cycle, saves the state
        assert trainer.poll() is None, "the trainer should still be logging NaN steps"
        time.sleep(2 * interval)  # steps logged while no watcher runs
        second = WatchProc(store_uri, tmp_path, "--tag-runs", interval=interval, name="second")
        assert trainer.wait(240) == 0, (tmp_path / "hf.log").read_text()[-3000:]
        client = MlflowClient(store_uri)
        (run,) = client.search_runs([client.get_experiment_by_name("hf").experiment_id])
        points = nonfinite_points(store_uri, run.info.run_id, "grad_norm")
        assert sorted(points) == list(range(nan_at, steps + 1))
        second.wait_for(lambda: len(steps_of(first.events() + second.events())) >= len(points), 60,
                        "alerts for every NaN step")
        time.sleep(2 * interval)  # and nothing more comes
    finally:
        trainer.kill()
        assert (second.stop() if second else 0) == 0
    a, b = steps_of(first.events()), steps_of(second.events())
    assert a and b and sorted(a + b) == sorted(points)  # no repeat, no miss
    assert all(e["keys"] == {"grad_norm": "nan"} and e["grad_norm"] == "nan" for e in first.events())
    lag = latency(first.events()[0], points)
    print(f"transformers: first alert {lag:.1f} s after step {nan_at} was logged; first watcher {len(a)} "
          f"alerts, second {len(b)}")
    assert first.events()[0]["step"] == nan_at and lag <= 2 * interval + 1.5
    tags = client.get_run(run.info.run_id).data.tags  # --tag-runs: counters continued across the restart
    assert tags[keys.TAG_ALERT_FIRST_STEP] == str(nan_at) and tags[keys.TAG_ALERT_COUNT] == str(len(points))


@pytest.mark.server
def test_server_killed_and_restarted_under_a_running_watcher(mlflow_server, tmp_path):
    uri = mlflow_server.uri
    client = MlflowClient(uri)
    exp = client.create_experiment("verl")
    run_id = client.create_run(exp, run_name="verl-ppo").info.run_id
    t = int(time.time() * 1000)
    log_raw(uri, run_id, [("actor/grad_norm", 0.5, t + s, s) for s in range(3)])
    w = WatchProc(uri, tmp_path, interval=1.0)
    try:
        w.polled()
        mlflow_server.kill()
        w.wait_for(lambda: "unreachable" in w.text(), 120, "the unreachable line")
        time.sleep(3)  # several failed polls
        mlflow_server.start()
        log_raw(uri, run_id, [("actor/grad_norm", INF, int(time.time() * 1000), 3)])  # stored as max-float
        (ev,) = w.wait_for(w.events, 120, "the alert after recovery")
    finally:
        assert w.stop() == 0
    text = w.text()
    assert text.count("unreachable") == 1 and uri in text  # one clear line, not one per failed poll
    assert "answers again" in text and text.index("unreachable") < text.index("answers again")
    assert ev["step"] == 3 and ev["grad_norm"] == "inf" and ev["keys"] == {"actor/grad_norm": "inf"}
    assert "Traceback" not in text


def test_once_says_what_it_skipped_and_all_reads_finished_runs(store_uri, tmp_path, caplog):
    # two runs that ended long ago, NaN at every step: a poll reads running and just-ended runs only,
    # so it must say it skipped them (not a bare "0 run(s) read"), and --all must alert on them
    from mlflow import MlflowClient

    ids = [write_run(store_uri, experiment="old", name=f"old-{i}", finish=False,
                     steps=[(s, {keys.GRAD_NORM: float("nan"), keys.GRAD_FINITE: 0.0}) for s in range(3)])
           for i in range(2)]
    for rid in ids:  # ended an hour before now
        MlflowClient(store_uri).set_terminated(rid, end_time=int(time.time() * 1000) - 3_600_000)
    state = str(tmp_path / "s.json")
    with caplog.at_level(logging.INFO, logger="rldiag.watch"):
        assert cli_main(["watch", "--once", "--tracking-uri", store_uri, "--state", state]) == 0
    assert "0 run(s) read" in caplog.text and "2 run(s) skipped" in caplog.text and "--all" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rldiag.watch"):
        assert cli_main(["watch", "--once", "--all", "--tracking-uri", store_uri, "--state", state]) == 1
    assert "2 run(s) read, 6 new alert(s)" in caplog.text and "skipped" not in caplog.text
    assert all(i in caplog.text for i in ids)


def test_an_unwatched_fp16_run_holds_a_short_streak_back_then_tells_it_as_a_likely_overflow(store_uri, tmp_path,
                                                                                          caplog):
    # logged as transformers' MLflowCallback logs a Trainer(fp16=True) run (params fp16=True; grad_norm inf at a
    # scaler overflow; loss through the Trainer's NaN filter): no grad/scaler_overflow tells overflows apart
    t = 1_700_000_000_000
    runs = {name: write_run(store_uri, name=name, params={"fp16": True}, finish=False)
            for name in ("fp16", "ended-in-it", "real-nan")}
    client = MlflowClient(store_uri)

    def rows(run: str, norms: dict[int, float], nan_loss: bool = False) -> None:
        log_raw(store_uri, runs[run], [p for s, v in norms.items() for p in (
            ("grad_norm", v, t + s, s), ("loss", NAN if nan_loss and not math.isfinite(v) else 2.0, t + s, s))])

    rows("fp16", {1: 3.0, 2: INF})
    rows("ended-in-it", {1: 3.0, 2: INF})
    rows("real-nan", {1: 3.0, 2: NAN}, nan_loss=True)  # a NaN loss is no overflow: alerted at once
    client.set_terminated(runs["ended-in-it"])  # a run that ends in a streak never came out of it: alerted
    alerts = tmp_path / "alerts.jsonl"
    w = Watcher(open_store(store_uri), WatchState.load(tmp_path / "state.json"), [JsonlSink(alerts)])
    with caplog.at_level(logging.INFO, logger="rldiag.watch"):
        res = w.poll()
    assert (res.alerts, res.pending) == (2, 1), read_events(alerts)
    assert sorted((e["run_name"], e["step"]) for e in read_events(alerts) if e["kind"] == "nonfinite_grad") == [
        ("ended-in-it", 2), ("real-nan", 2)]
    assert "1 non-finite step(s) of running fp16 run(s) held back" in caplog.text

    rows("fp16", {3: 2.5, 4: 2.4})  # the scaler came out of it: a likely overflow, told, not alerted
    res = w.poll()
    assert (res.alerts, res.pending, res.notes) == (0, 0, 1)
    [note] = [e for e in read_events(alerts) if e["kind"] == "likely_scaler_overflow"]
    assert note["run_name"] == "fp16" and note["steps"] == [2]
    assert "likely loss-scaler overflows" in note["text"] and "not alerted" in note["text"]
    assert w.poll().notes == 0  # told once

    rows("fp16", {s: INF for s in range(5, 5 + 7)})  # 7 rows: still an overflow's length, held back
    assert (w.poll().alerts, w.poll().pending) == (0, 7)
    rows("fp16", {12: INF})  # the 8th in a row: more than a scale settles in, alerted from its first step
    res = w.poll()
    assert res.alerts == 8 and res.pending == 0
    assert steps_of(read_events(alerts), runs["fp16"]) == list(range(5, 13))
    w.close()


def test_steps_with_no_valid_tokens_are_told_once_and_never_alerted(store_uri, tmp_path):
    # a running GRPO run whose completions were all masked at steps 3 and 4 (batch/valid_tokens 0, the
    # placeholders ratio 1 and KL 0 beside it): no NaN anywhere, but the watcher says those steps measured nothing
    t = 1_700_000_000_000
    run = running_run(store_uri, "truncated")
    tokens = {1: 120.0, 2: 96.0, 3: 0.0, 4: 0.0, 5: 88.0}
    log_raw(store_uri, run, [p for s, n in tokens.items() for p in (
        (keys.BATCH_TOKENS, n, t + s, s), (keys.RATIO_MEAN, 1.0 if n == 0 else 1.01, t + s, s),
        (keys.GRAD_NORM, 0.5, t + s, s))])
    alerts = tmp_path / "alerts.jsonl"
    w = Watcher(open_store(store_uri), WatchState.load(tmp_path / "state.json"), [JsonlSink(alerts)])
    res = w.poll()
    assert (res.alerts, res.notes) == (0, 1), read_events(alerts)
    [note] = read_events(alerts)
    assert note["kind"] == "no_valid_tokens" and note["steps"] == [3, 4] and note["run_name"] == "truncated"
    assert "no valid tokens (batch/valid_tokens 0) at 2 step(s) (3, 4)" in note["text"]
    assert w.poll().notes == 0  # told once
    log_raw(store_uri, run, [(keys.BATCH_TOKENS, 0.0, t + 9, 9)])
    res = w.poll()
    assert (res.alerts, res.notes) == (0, 1)
    assert read_events(alerts)[-1]["steps"] == [9]
    # a restart on the same state file tells nothing again
    w2 = Watcher(open_store(store_uri), WatchState.load(tmp_path / "state.json"), [JsonlSink(alerts)])
    assert w2.poll().notes == 0 and len(read_events(alerts)) == 2


def test_a_run_logged_with_no_step_is_alerted_at_its_place_in_logging_order(store_uri, tmp_path):
    # `mlflow.log_metric("grad_norm", v)` with no step: MLflow stores every value at step 0, so "at step 12"
    # names a step the user's MLflow UI does not have; the alert says where in the logging order it was
    # (MLflow's client call, as the fluent mlflow.log_metric makes it; the fluent API's global tracking URI
    # would outlive this test)
    client = MlflowClient(store_uri)
    run_id = client.create_run(client.create_experiment("nostep"), run_name="nostep").info.run_id
    for i in range(16):
        t = 1_700_000_000_000 + 10 * i  # no step; a time of its own, as a loop's points have
        client.log_metric(run_id, "grad_norm", NAN if i >= 12 else 0.5 + 0.01 * i, timestamp=t)
        client.log_metric(run_id, "loss", NAN if i in (5, 14) else 1.0 - 0.01 * i, timestamp=t)  # 5: NaN loss only
    client.set_terminated(run_id)
    assert {m.step for m in client.get_metric_history(run_id, "grad_norm")} == {0}
    alerts = tmp_path / "alerts.jsonl"
    w = Watcher(open_store(store_uri), WatchState.load(tmp_path / "state.json"), [JsonlSink(alerts)], include_finished=True)
    w.poll()
    got = read_events(alerts)
    assert steps_of(got) == [12, 13, 14, 15]
    first = [e for e in got if e["kind"] == "nonfinite_grad"][0]["text"]
    assert "at value 12 in logging order (counted from 0; logged with no step, so MLflow shows every value at step 0)" \
        in first, first
    assert "at step 12" not in first
    [loss] = [e["text"] for e in got if e["kind"] == "nonfinite_loss"]
    assert "loss is nan in run nostep" in loss and "at value 5 in logging order (counted from 0;" in loss, loss


def test_each_new_departure_is_sent_once_a_burst_that_ended_then_a_lasting_shift(store_uri, tmp_path):
    """A running candidate's ratio mean bursts 10 sd up at steps 60-74 and comes back, then shifts 6 sd up
    for good from step 200: the first poll (to step 150) sends the burst, with where it came back; the
    second (to step 300) sends the lasting shift and not the burst again; a restart on the state file, and
    a state written before departures were kept (the first departure's onset only), repeat neither."""
    rng = np.random.default_rng(7)
    group = {keys.TAG_GROUP: "later"}
    for seed in range(3):
        noise = rng.normal(0, 0.01, 300)
        write_run(store_uri, name=f"ref{seed}", tags={**group, keys.TAG_ROLE: "reference"},
                  steps=[(s, {keys.RATIO_MEAN: 1.0 + noise[s]}) for s in range(300)])
    s = np.arange(300)
    values = 1.0 + rng.normal(0, 0.01, 300) + np.where((s >= 60) & (s < 75), 0.1, 0.0) + np.where(s >= 200, 0.06, 0.0)
    cand = write_run(store_uri, name="cand", tags={**group, keys.TAG_ROLE: "candidate"}, finish=False,
                     steps=[(i, {keys.RATIO_MEAN: float(values[i])}) for i in range(150)])
    alerts, state = tmp_path / "alerts.jsonl", tmp_path / "s.json"
    w = Watcher(open_store(store_uri), WatchState.load(state), [JsonlSink(alerts)], divergence=True)
    assert w.poll().alerts == 1
    (burst,) = read_events(alerts)
    assert burst["run_id"] == cand and burst["key"] == keys.RATIO_MEAN and 58 <= burst["onset_step"] <= 62
    assert burst["end_step"] is not None and 72 <= burst["end_step"] <= 80, burst
    assert f"came back after step {burst['end_step']}" in burst["text"], burst["text"]
    assert w.poll().alerts == 0
    write_run(store_uri, run_id=cand, finish=False,
              steps=[(i, {keys.RATIO_MEAN: float(values[i])}) for i in range(150, 300)])
    assert w.poll().alerts == 1
    first, shift = read_events(alerts)
    assert first == burst and shift["key"] == keys.RATIO_MEAN and 195 <= shift["onset_step"] <= 204, shift
    assert shift["end_step"] is None and shift["alert_step"] >= shift["onset_step"] and shift["departure"] == "level"
    assert when_text(shift["onset_step"], shift["alert_step"]) + " (level, delta 0.0" in shift["text"], shift["text"]
    assert w.poll().alerts == 0
    told = json.loads(state.read_text())["runs"][cand]
    assert told["diverged"] == {keys.RATIO_MEAN: burst["onset_step"]}
    assert told["noted"]["divergence " + keys.RATIO_MEAN] == [[burst["onset_step"], burst["alert_step"]],
                                                              [shift["onset_step"], shift["alert_step"]]]
    restarted = Watcher(open_store(store_uri), WatchState.load(state), [JsonlSink(alerts)], divergence=True)
    assert restarted.poll().alerts == 0
    # a state file from a watcher that kept only the first departure's onset: the later departure is sent, once
    del told["noted"]["divergence " + keys.RATIO_MEAN]
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"version": 1, "last_poll_ms": None, "runs": {cand: told}}))
    older = tmp_path / "older.jsonl"
    w3 = Watcher(open_store(store_uri), WatchState.load(old), [JsonlSink(older)], divergence=True)
    assert w3.poll().alerts == 1 and [e["onset_step"] for e in read_events(older)] == [shift["onset_step"]]
    assert w3.poll().alerts == 0
