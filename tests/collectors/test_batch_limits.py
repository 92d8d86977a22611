"""MLflow's batch limits and refusals, with faults combined, against real stores (a SQLite file, a real
`mlflow server`): every point is stored exactly once or accounted for as refused.

- every `log_batch` call fits MLflow's limits (metrics + params + tags, tags, request bytes);
- keys are checked against MLflow's own rules before they are journaled (pinned to MLflow's code);
- an outage, then a NaN alert (its tags in the same batches), then recovery: every step stored;
- `rldiag sync` of such a journal, and of one an older rldiag wrote (1000 points + tags per batch);
- keys MLflow refuses in the middle of a backlog: set aside, counted, warned once; the rest delivered;
- a run the store refuses as a whole (deleted): kept and retried, not set aside;
- a locked SQLite file: retried, never set aside.
"""

from __future__ import annotations

import json
import logging
import math
import random
import sqlite3
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from rldiag.app.cli.main import main
from rldiag.collectors import keys, limits
from rldiag.collectors import writer as writer_mod
from rldiag.collectors.alerts import AlertDispatcher, LoggingSink, MlflowTagSink, NonFiniteGradAlert
from rldiag.collectors.journal import journal_path, read_journal
from rldiag.collectors.limits import Refused, clean_key, key_problem
from rldiag.collectors.mlflow_store import log_batch_json, make_sender, open_run, refused_for_good
from rldiag.collectors.writer import MetricWriter

KEYS = [f"layer{i:02d}/grad_norm" for i in range(50)]  # 50 keys a step
STEPS = 200
NAN_STEP = 100


def new_run(uri: str, name: str = "limits") -> str:
    return open_run(uri, experiment="batch-limits", run_name=name)[1].info.run_id


def stored(uri: str, run_id: str, names) -> Counter:
    """(key, step) -> how many rows the store holds."""
    c = MlflowClient(uri)
    return Counter((m.key, m.step) for k in names for m in c.get_metric_history(run_id, k))


def step_values(step: int) -> dict[str, float]:
    vals = {k: step + i / 100 for i, k in enumerate(KEYS)}
    if step == NAN_STEP:
        vals[KEYS[0]] = float("nan")
    return vals


def assert_every_step_once(uri: str, run_id: str) -> None:
    got = stored(uri, run_id, KEYS)
    assert set(got) == {(k, s) for k in KEYS for s in range(STEPS)}  # every step of every key ...
    assert set(got.values()) == {1}  # ... exactly once
    nan = [m for m in MlflowClient(uri).get_metric_history(run_id, KEYS[0]) if m.step == NAN_STEP]
    assert len(nan) == 1 and math.isnan(nan[0].value)  # the NaN step is among the stored
    tags = MlflowClient(uri).get_run(run_id).data.tags
    assert tags[keys.TAG_ALERT_COUNT] == "1" and tags[keys.TAG_ALERT_FIRST_STEP] == str(NAN_STEP)
    assert json.loads(tags[keys.TAG_ALERT_LAST])["step"] == NAN_STEP


def train_with_alert(w: MetricWriter, run_id: str) -> None:
    """200 steps of 50 keys; at step 100 a NaN and the alert, whose MLflow tags go through the writer."""
    alerts = AlertDispatcher([LoggingSink(), MlflowTagSink(w.set_tags)])
    for step in range(STEPS):
        w.log_metrics(step_values(step), step)
        if step == NAN_STEP:
            alerts.emit(NonFiniteGradAlert(run_id=run_id, step=step, grad_norm=float("nan"), params=["w"]))


def wait_for(cond, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)


def journaled_points(path: Path) -> int:
    """Points in the journal so far: 0 before its file is there, and while it is still empty (the writer makes
    the file, O_EXCL, then writes its header line: a poll in between read it as "not an rldiag journal")."""
    if not path.exists() or path.stat().st_size == 0:
        return 0
    return sum(len(b.metrics) for b in read_journal(path).pending)


class Down:
    """A sender that fails as a stopped store does (connection refused) until `up` is set."""

    def __init__(self, send):
        self.send, self.up = send, threading.Event()

    def __call__(self, run_id, metrics, tags):
        if not self.up.is_set():
            raise ConnectionRefusedError(111, "Connection refused")
        self.send(run_id, metrics, tags)


# ---- MLflow's own rules and limits --------------------------------------------------------------
def mlflow_refuses(key: str) -> bool:
    from mlflow.utils.validation import (
        MAX_ENTITY_KEY_LENGTH,
        _validate_length_limit,
        _validate_metric_name,
        _validate_tag_name,
    )

    verdicts = []
    for check in (_validate_metric_name, _validate_tag_name):
        try:
            check(key)
            _validate_length_limit("key", MAX_ENTITY_KEY_LENGTH, key)
            verdicts.append(False)
        except MlflowException:
            verdicts.append(True)
    assert verdicts[0] == verdicts[1]  # metric and tag names follow the same rules
    return verdicts[0]


TRICKY = ["loss", "eval/../loss", "a/./b", "./a", "a/.", "a/..", "..", ".", "..a", "...", "a/..b", ".hidden",
          "", " ", "a b:c-d_e.f", "/a", "a/", "a//b", "//a", "x<y>", "é/学习", "🚀", "a\nb", "a\n", "tab\there",
          "k" * 239, "k" * 240, "k" * 250, "k" * 251, "é" * 251, keys.inf_flag_key("k" * 239),
          keys.inf_flag_key("k" * 240), "rank0/" + "x" * 250, "a/" + "." * 3 + "/b", "a:/b", "C:\\path"]


def test_key_rules_and_limits_are_mlflows():
    from mlflow.utils import validation as v

    assert (limits.MAX_ENTITIES, limits.MAX_BATCH, limits.MAX_TAGS, limits.MAX_REQUEST_BYTES,
            limits.MAX_KEY_CHARS, limits.MAX_TAG_VALUE_CHARS) == (
        v.MAX_ENTITIES_PER_BATCH, v.MAX_METRICS_PER_BATCH, v.MAX_PARAMS_TAGS_PER_BATCH,
        v.MAX_BATCH_LOG_REQUEST_SIZE, v.MAX_ENTITY_KEY_LENGTH, v.MAX_TAG_VAL_LENGTH)
    rng = random.Random(0)
    alphabet = "ab./ _-:é\n<"
    fuzz = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8))) for _ in range(3000)]
    for key in TRICKY + fuzz:
        assert (key_problem(key) is not None) == mlflow_refuses(key), key
        cleaned = clean_key(key)
        assert not mlflow_refuses(cleaned) and not mlflow_refuses(keys.inf_flag_key(cleaned)), (key, cleaned)
        assert clean_key(cleaned) == cleaned  # stable: a cleaned key is kept as it is
        if key_problem(key) is None and len(key) <= limits.MAX_METRIC_KEY_CHARS:
            assert cleaned == key  # a key MLflow accepts (with room for its inf flag) is never renamed
        tag = clean_key(key, limits.MAX_KEY_CHARS)
        assert not mlflow_refuses(tag) and (tag == key or key_problem(key) is not None)


def test_http_refusals_for_good_are_the_4xx_that_do_not_pass():
    assert all(refused_for_good(s) for s in (400, 401, 403, 404, 413, 422))
    assert not any(refused_for_good(s) for s in (200, 408, 409, 429, 499, 500, 502, 503, 504))


def test_every_call_fits_mlflows_limits(sqlite_uri, tmp_path):
    """Long non-ASCII keys (each point over 1 kB of JSON: 1000 points would pass MLflow's 1 MB body
    limit), 150 tags in one call and alert tags: every call fits, every point arrives once."""
    from mlflow.utils.validation import MAX_BATCH_LOG_REQUEST_SIZE, _validate_batch_log_limits

    run_id = new_run(sqlite_uri)
    real = make_sender(sqlite_uri)
    calls = []

    def checked(rid, metrics, tags):
        _validate_batch_log_limits(metrics, [], list(tags))  # raises past MLflow's counts
        calls.append((len(metrics), len(tags), len(log_batch_json(rid, metrics, tags, {}))))
        real(rid, metrics, tags)

    names = [f"{i:02d}/" + "é" * 200 for i in range(20)]
    w = MetricWriter(run_id, checked, tracking_uri=sqlite_uri, spill_dir=tmp_path / "spill", send_interval_s=5.0)
    w.set_tags({f"cfg.{i}": "v" * 100 for i in range(150)})
    for step in range(150):
        w.log_metrics({n: float(step) for n in names}, step)
        if step == 75:
            MlflowTagSink(w.set_tags).send({"kind": "nonfinite_grad", "step": step, "grad_norm": "nan",
                                            "params": ["w"]})
    stats = w.close(timeout=120)
    assert stats.undelivered == 0 and stats.refused == 0
    assert max(b for _, _, b in calls) <= MAX_BATCH_LOG_REQUEST_SIZE
    assert max(t for _, t, _ in calls) <= 100
    assert sum(m for m, _, _ in calls) == 150 * 20 and sum(t for _, t, _ in calls) == 153
    got = stored(sqlite_uri, run_id, names)
    assert set(got) == {(n, s) for n in names for s in range(150)} and set(got.values()) == {1}
    run_tags = MlflowClient(sqlite_uri).get_run(run_id).data.tags
    assert len([t for t in run_tags if t.startswith("cfg.")]) == 150 and run_tags[keys.TAG_ALERT_COUNT] == "1"


def test_keys_mlflow_refuses_are_cleaned_before_the_journal(sqlite_uri, tmp_path, caplog):
    run_id = new_run(sqlite_uri)
    w = MetricWriter(run_id, make_sender(sqlite_uri), tracking_uri=sqlite_uri, spill_dir=tmp_path / "spill")
    long = "k" * 245  # MLflow takes it, but not its inf flag rldiag/inf/<key> (256 characters)
    with caplog.at_level(logging.WARNING, logger="rldiag.writer"):
        for step in range(3):
            w.log_metrics({"eval/../loss": 1.0, "a/./b": 2.0, "..x": 3.0, long: float("inf")}, step)
        w.set_tags({"bad//tag": "x" * 9000})
        stats = w.close(timeout=60)
    assert stats.undelivered == 0 and stats.refused == 0
    c = MlflowClient(sqlite_uri)
    assert [m.step for m in c.get_metric_history(run_id, "eval/__/loss")] == [0, 1, 2]
    assert len(c.get_metric_history(run_id, "a/b")) == 3 and len(c.get_metric_history(run_id, "_.x")) == 3
    assert len(c.get_metric_history(run_id, keys.inf_flag_key("k" * 239))) == 3  # the flag fits
    assert c.get_run(run_id).data.tags["bad/tag"] == "x" * 8000
    for bad, good in [("eval/../loss", "eval/__/loss"), ("a/./b", "a/b"), ("..x", "_.x"), (long, "k" * 239)]:
        assert caplog.text.count(repr(bad)) == 1 and repr(good) in caplog.text  # once per key, both names


# ---- outage, then an alert, then recovery ---------------------------------------------------------
def test_outage_then_nan_alert_then_sync_delivers_every_step(sqlite_uri, tmp_path):
    """The store is down the whole run (the sender fails as a stopped server does): close() gives up,
    the journal holds 200 steps x 50 keys and the alert's tags; `rldiag sync` delivers all of it."""
    run_id = new_run(sqlite_uri)
    down = Down(make_sender(sqlite_uri))
    spill = tmp_path / "spill"
    w = MetricWriter(run_id, down, tracking_uri=sqlite_uri, spill_dir=spill, backoff_s=(0.01, 0.05))
    train_with_alert(w, run_id)
    path = journal_path(spill, run_id)
    wait_for(lambda: journaled_points(path) == STEPS * len(KEYS), "the journal to hold every point")
    stats = w.close(timeout=1)
    assert stats.delivered == 0 and stats.undelivered == STEPS * len(KEYS) + 3  # 3 alert tags
    assert main(["sync", str(path)]) == 0
    assert_every_step_once(sqlite_uri, run_id)
    assert not path.exists()


def old_journal(path: Path, run_id: str, uri: str, bad: dict[int, dict[str, float]]) -> int:
    """A journal as rldiag before this fix wrote it: 1000 points and the alert's 3 tags in one batch
    (MLflow refuses the call: 1003 entities), and `bad` keys at some steps. Returns the bad points."""
    lines = [{"rldiag_journal": 1, "run_id": run_id, "tracking_uri": uri}]
    points = []
    for step in range(STEPS):
        points += [[k, v, 1_700_000_000_000 + step, step] for k, v in step_values(step).items()]
        points += [[k, v, 1_700_000_000_000 + step, step] for k, v in bad.get(step, {}).items()]
    tags = {keys.TAG_ALERT_COUNT: "1", keys.TAG_ALERT_FIRST_STEP: str(NAN_STEP),
            keys.TAG_ALERT_LAST: json.dumps({"step": NAN_STEP})}
    for seq, i in enumerate(range(0, len(points), 1000)):
        lines.append({"seq": seq, "m": points[i:i + 1000], **({"t": tags} if i // 1000 == 5 else {})})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return sum(len(v) for v in bad.values())


@pytest.mark.parametrize("mode", ["rules", "split", "split+flaky"])
def test_keys_mlflow_refuses_in_a_backlog_are_set_aside_and_the_rest_delivered(sqlite_uri, tmp_path, caplog,
                                                                                monkeypatch, mode):
    """`rldiag sync` of an older journal with keys the store refuses in the middle of the backlog.
    rules: MLflow's rules name the refused points; split: the writer does not know why (the check is
    switched off) and isolates them by splitting the refused calls; flaky: and every third call fails
    as a dropped connection does, in the middle of the splitting."""
    run_id = new_run(sqlite_uri)
    path = tmp_path / f"{run_id}.jsonl"
    bad = {s: {"eval/../loss": float(s)} for s in range(60, 80)}
    bad[90] = {"k" * 251: 9.5}
    bad[95] = {keys.inf_flag_key("x" * 245): 1.0}
    n_bad = old_journal(path, run_id, sqlite_uri, bad)
    real = make_sender(sqlite_uri)
    calls = Counter()

    def send(rid, metrics, tags):
        calls["all"] += 1
        if mode == "split+flaky" and calls["all"] % 3 == 0:
            raise ConnectionResetError(104, "Connection reset by peer")
        try:
            real(rid, metrics, tags)
        except Refused:
            calls["refused"] += 1
            raise

    if mode != "rules":
        monkeypatch.setattr(writer_mod, "entry_problem", lambda entry: None)
    from rldiag.collectors.sync import sync_journal

    with caplog.at_level(logging.WARNING, logger="rldiag.writer"):
        if mode == "split+flaky":  # what sync_journal does, with a short back-off for the many failures
            assert read_journal(path).corrupt_lines == 0
            w = MetricWriter(run_id, send, tracking_uri=sqlite_uri, journal_file=path, backoff_s=(0.001, 0.01))
            stats, corrupt = w.close(timeout=120), 0
            assert stats.send_failures > 10
        else:
            stats, corrupt = sync_journal(path, send=send, timeout_s=120)
    assert corrupt == 0 and stats.undelivered == 0
    assert stats.refused == n_bad == 22
    assert stats.delivered == STEPS * len(KEYS) + 3
    assert_every_step_once(sqlite_uri, run_id)
    assert MlflowClient(sqlite_uri).get_metric_history(run_id, "eval/__/loss") == []  # set aside, not renamed
    for key, step, value in [("eval/../loss", 60, 60.0), ("k" * 251, 90, 9.5), (keys.inf_flag_key("x" * 245), 95, 1.0)]:
        said = [r.getMessage() for r in caplog.records if "refused metric " + repr(key) in r.getMessage()]
        assert len(said) == 1, said  # one warning per key, naming key, value and step
        assert f"= {value!r} at step {step}" in said[0]
    assert f"refused {n_bad} metric points" in caplog.text  # the close summary counts them
    assert not path.exists()
    if mode != "rules":  # splitting costs about log2(1000) refused calls per refused point, not one per point
        assert calls["refused"] < 12 * n_bad


def test_a_run_the_store_refuses_whole_is_kept_and_retried_not_set_aside(sqlite_uri, tmp_path, caplog):
    """The run is deleted mid-training: the store refuses everything for it, an empty call too. That is
    not about the points: they are kept (journal) and retried, and delivered once the run is restored."""
    run_id = new_run(sqlite_uri)
    spill = tmp_path / "spill"
    w = MetricWriter(run_id, make_sender(sqlite_uri), tracking_uri=sqlite_uri, spill_dir=spill,
                     backoff_s=(0.01, 0.05))
    for step in range(100):
        w.log_metrics(step_values(step), step)
    assert w.flush(timeout=60)
    MlflowClient(sqlite_uri).delete_run(run_id)
    with caplog.at_level(logging.WARNING, logger="rldiag.writer"):
        for step in range(100, STEPS):
            w.log_metrics(step_values(step), step)
            if step == NAN_STEP:
                MlflowTagSink(w.set_tags).send({"kind": "nonfinite_grad", "step": step, "grad_norm": "nan",
                                                "params": ["w"]})
        path = journal_path(spill, run_id)
        wait_for(lambda: w.stats.send_failures > 0 and journaled_points(path) == 100 * len(KEYS), "refusals")
        stats = w.close(timeout=1)
    assert stats.refused == 0 and stats.undelivered == 100 * len(KEYS) + 3
    assert caplog.text.count("refuses every write to run") == 1 and "refused metric" not in caplog.text
    MlflowClient(sqlite_uri).restore_run(run_id)
    assert main(["sync", str(path)]) == 0
    assert_every_step_once(sqlite_uri, run_id)


@pytest.mark.slow
def test_a_locked_sqlite_file_is_retried_never_set_aside(sqlite_uri, tmp_path):
    """Another process holds SQLite's write lock past MLflow's 20 s busy timeout: "database is locked"
    is retried, nothing is refused, and everything arrives once the lock is released."""
    run_id = new_run(sqlite_uri)
    w = MetricWriter(run_id, make_sender(sqlite_uri), tracking_uri=sqlite_uri, spill_dir=tmp_path / "spill",
                     backoff_s=(0.05, 0.2))
    db = sqlite3.connect(sqlite_uri.removeprefix("sqlite:///"), isolation_level=None)
    db.execute("BEGIN EXCLUSIVE")
    try:
        for step in range(20):
            w.log_metrics(step_values(step), step)
        wait_for(lambda: w.stats.send_failures > 0, "a failed send while the file is locked", timeout=180)
        assert w.stats.refused == 0 and "locked" in (w.stats.last_error or "")
    finally:
        db.execute("ROLLBACK")
        db.close()
    stats = w.close(timeout=120)
    assert stats.undelivered == 0 and stats.refused == 0
    got = stored(sqlite_uri, run_id, KEYS)
    assert set(got) == {(k, s) for k in KEYS for s in range(20)} and set(got.values()) == {1}


# ---- through a real `mlflow server` -------------------------------------------------------------------
@pytest.mark.server
@pytest.mark.slow
def test_server_outage_then_nan_alert_then_recovery_and_sync(mlflow_server, tmp_path):
    """The server is killed right after the runs open; 200 steps x 50 keys are logged with a NaN and its
    alert at step 100 while it is down; the server comes back. Run A's writer delivers the backlog
    (full groups, the alert's tags among them); run B's writer gave up during the outage and
    `rldiag sync` delivers its journal. Both: every step once, the NaN step included."""
    uri = mlflow_server.uri
    runs = {name: new_run(uri, name) for name in "AB"}
    spill = tmp_path / "spill"
    writers = {name: MetricWriter(rid, make_sender(uri, request_timeout_s=10), tracking_uri=uri, spill_dir=spill,
                                  backoff_s=(0.1, 1.0)) for name, rid in runs.items()}
    mlflow_server.kill()
    for name, w in writers.items():
        train_with_alert(w, runs[name])
    for rid in runs.values():
        wait_for(lambda rid=rid: journaled_points(journal_path(spill, rid)) == STEPS * len(KEYS), "the journals")
    wait_for(lambda: writers["A"].stats.send_failures > 0, "a failed send to the dead server")
    assert writers["A"].stats.delivered == 0
    b = writers["B"].close(timeout=1)
    assert b.delivered == 0 and b.undelivered == STEPS * len(KEYS) + 3
    mlflow_server.start()
    a = writers["A"].close(timeout=180)
    assert a.undelivered == 0 and a.refused == 0 and a.delivered == STEPS * len(KEYS) + 3
    assert_every_step_once(uri, runs["A"])
    assert main(["sync", str(journal_path(spill, runs["B"]))]) == 0
    assert_every_step_once(uri, runs["B"])


@pytest.mark.server
@pytest.mark.slow
def test_server_refusals_are_isolated_and_the_rest_delivered(mlflow_server, tmp_path, caplog, monkeypatch):
    """A real server's 400 answers, with the writer's own key checks switched off so that the keys
    reach it: the refused points are isolated by splitting, counted and warned about once per key;
    a refusal is never retried as an outage."""
    uri = mlflow_server.uri
    run_id = new_run(uri)
    monkeypatch.setattr(writer_mod, "clean_key", lambda key, max_chars=0: key)
    monkeypatch.setattr(writer_mod, "entry_problem", lambda entry: None)
    w = MetricWriter(run_id, make_sender(uri, request_timeout_s=30), tracking_uri=uri, spill_dir=tmp_path / "spill",
                     send_interval_s=5.0)  # a backlog: several full groups go out at once
    with caplog.at_level(logging.WARNING, logger="rldiag.writer"):
        for step in range(STEPS):
            vals = step_values(step)
            if 60 <= step < 80:
                vals["eval/../loss"] = float(step)
            if step == 90:
                vals["k" * 251] = 9.5
            w.log_metrics(vals, step)
        alerts = AlertDispatcher([MlflowTagSink(w.set_tags)])
        alerts.emit(NonFiniteGradAlert(run_id=run_id, step=NAN_STEP, grad_norm=float("nan"), params=["w"]))
        stats = w.close(timeout=180)
    assert stats.undelivered == 0 and stats.refused == 21 and stats.send_failures == 0
    assert_every_step_once(uri, run_id)
    assert caplog.text.count("refused metric 'eval/../loss'") == 1
    assert "refused metric 'eval/../loss' = 60.0 at step 60" in caplog.text
    assert caplog.text.count("refused metric " + repr("k" * 251)) == 1
