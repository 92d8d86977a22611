"""The background writer against real MLflow stores: SQLite file and a real `mlflow server`."""

from __future__ import annotations

import json
import logging
import math
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from rldiag.collectors import keys
from rldiag.collectors.journal import journal_path, read_journal
from rldiag.collectors.limits import clean_key
from rldiag.collectors.mlflow_store import make_sender, open_run
from rldiag.collectors.writer import MetricWriter

MAX_FLOAT = 1.7976931348623157e308


def new_run(uri: str, name: str = "w") -> str:
    _, run = open_run(uri, experiment="writer-tests", run_name=name)
    return run.info.run_id


def history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, key))


def test_every_point_once_nan_and_inf_survive_sqlite(sqlite_uri, tmp_path):
    run_id = new_run(sqlite_uri)
    w = MetricWriter(run_id, make_sender(sqlite_uri), tracking_uri=sqlite_uri, spill_dir=tmp_path / "spill")
    for step in range(2500):
        w.log_metrics({"a": step * 0.5, "b/c": -step, "d": 1.0}, step)
    w.log_metrics({"grad/norm": float("nan"), "x": float("inf"), "y": float("-inf")}, 2500)
    stats = w.close(timeout=120)

    assert stats.undelivered == 0 and stats.rejected == 0
    a = history(sqlite_uri, run_id, "a")
    assert a == [(s, s * 0.5) for s in range(2500)]  # every step exactly once, in order, exact values
    assert len(history(sqlite_uri, run_id, "b/c")) == 2500
    (nan_step, nan_val), = history(sqlite_uri, run_id, "grad/norm")
    assert nan_step == 2500 and math.isnan(nan_val)
    # The SQL store clamps inf to max-float; the flag tells them apart.
    assert history(sqlite_uri, run_id, "x") == [(2500, MAX_FLOAT)]
    assert history(sqlite_uri, run_id, keys.inf_flag_key("x")) == [(2500, 1.0)]
    assert history(sqlite_uri, run_id, keys.inf_flag_key("y")) == [(2500, -1.0)]
    assert not journal_path(tmp_path / "spill", run_id).exists()  # fully delivered: journal removed


def test_bad_values_and_keys_are_reported_not_fatal(sqlite_uri, tmp_path, caplog):
    import torch

    run_id = new_run(sqlite_uri)
    w = MetricWriter(run_id, make_sender(sqlite_uri), spill_dir=tmp_path / "spill")
    with caplog.at_level(logging.WARNING, logger="rldiag.writer"):
        w.log_metrics({"ok": 1.0, "none": None, "text": "high", "t": torch.tensor(2.5), "bad key!": 3.0}, 0)
        stats = w.close(timeout=60)
    assert stats.rejected == 2 and stats.undelivered == 0
    assert history(sqlite_uri, run_id, "ok") == [(0, 1.0)]
    assert history(sqlite_uri, run_id, "t") == [(0, 2.5)]
    assert history(sqlite_uri, run_id, "bad key_") == [(0, 3.0)]
    assert "'none'" in caplog.text and "not a number" in caplog.text
    assert "'bad key!'" in caplog.text and "'bad key_'" in caplog.text


@pytest.mark.parametrize("key,expected", [("a//b", "a/b"), ("/a", "a"), ("a/", "a"), ("é ok", "é ok"),
                                          ("x<y>", "x_y_"), ("eval/../loss", "eval/__/loss"), ("a/./b", "a/b"),
                                          ("..x", "_.x"), ("", "_"), ("k" * 239, "k" * 239),
                                          ("k" * 300, "k" * 239)])  # 239: room for rldiag/inf/<key> in 250
def test_clean_key(key, expected):
    assert clean_key(key) == expected


def test_unreachable_store_close_is_bounded_and_sync_replays(sqlite_uri, tmp_path, caplog):
    """A store that refuses everything: close() returns within its bound, counts what is left, keeps
    the journal; `rldiag sync` later delivers it exactly once."""
    run_id = new_run(sqlite_uri)
    good = make_sender(sqlite_uri)

    def down(run_id, metrics, tags):
        raise ConnectionError("store down")

    w = MetricWriter(run_id, down, tracking_uri=sqlite_uri, spill_dir=tmp_path / "spill", backoff_s=(0.01, 0.05))
    for step in range(300):
        w.log_metrics({"m": float(step)}, step)
    with caplog.at_level(logging.ERROR, logger="rldiag.writer"):
        stats = w.close(timeout=2)
    assert stats.delivered == 0 and stats.undelivered == 300 and stats.send_failures > 0
    path = journal_path(tmp_path / "spill", run_id)
    assert path.exists()
    assert f"rldiag sync {path}" in caplog.text and "300 metric points" in caplog.text
    assert history(sqlite_uri, run_id, "m") == []

    from rldiag.app.cli.main import main

    with path.open("a") as f:  # damage: a torn line, as from a process killed mid-write
        f.write('{"seq": 99, "m": [["m", 1.0, 17')
    assert main(["sync", str(path)]) == 0
    assert history(sqlite_uri, run_id, "m") == [(s, float(s)) for s in range(300)]
    assert not path.exists()
    del good


def test_restart_of_same_run_replays_journal_of_killed_process(sqlite_uri, tmp_path):
    """The training process is SIGKILLed while the store is slow: what it enqueued more than ~100 ms
    before the kill is in the journal and delivered when a writer starts again for the run."""
    run_id = new_run(sqlite_uri)
    spill = tmp_path / "spill"
    child = textwrap.dedent(f"""
        import os, signal, time
        from rldiag.collectors.writer import MetricWriter
        def slow(run_id, metrics, tags):
            time.sleep(60)  # the store never answers before the kill
        w = MetricWriter({run_id!r}, slow, spill_dir={str(spill)!r})
        for step in range(400):
            w.log_metrics({{"m": float(step), "n": 2.0 * step}}, step)
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", child], check=False, cwd=Path(__file__).parents[2], timeout=120)
    assert proc.returncode == -signal.SIGKILL
    contents = read_journal(journal_path(spill, run_id))
    assert sum(len(b.metrics) for b in contents.pending) == 800 and contents.corrupt_lines == 0

    w = MetricWriter(run_id, make_sender(sqlite_uri), spill_dir=spill)  # "next start of the same run"
    w.log_metrics({"m": 400.0, "n": 800.0}, 400)
    stats = w.close(timeout=60)
    assert stats.replayed == 800 and stats.undelivered == 0
    assert history(sqlite_uri, run_id, "m") == [(s, float(s)) for s in range(401)]
    assert history(sqlite_uri, run_id, "n") == [(s, 2.0 * s) for s in range(401)]


def test_flush_waits_for_delivery(sqlite_uri, tmp_path):
    run_id = new_run(sqlite_uri)
    w = MetricWriter(run_id, make_sender(sqlite_uri), spill_dir=tmp_path / "spill")
    w.log_metrics({"f": 1.0}, 0)
    assert w.flush(timeout=60)
    assert history(sqlite_uri, run_id, "f") == [(0, 1.0)]  # visible before close
    w.close()


@pytest.mark.server
def test_log_batch_body_is_what_mlflow_sends():
    """The REST sender's hand-built body reads back as MLflow's own encoding of the same batch:
    NaN and +-inf as protobuf spells them, unicode, quotes and backslashes in keys and tags."""
    from mlflow.entities import Metric, RunTag
    from mlflow.protos.service_pb2 import LogBatch
    from mlflow.utils.proto_json_utils import message_to_json

    from rldiag.collectors.mlflow_store import log_batch_json

    points = [("loss", 0.1, 1_700_000_000_123, 0), ("grad/norm", float("nan"), 1, 2**40),
              ("rldiag/inf/x", float("inf"), 2, 3), ("x", float("-inf"), 2, 3), ('k\\"é', -1e-300, 5, 7),
              ("big", 1.7976931348623157e308, 6, 8), ("int-like", 3.0, 7, 9)]
    tags = {"rldiag.alert.last": '{"step": 3, "name": "<img src=x>"}', "ü": "\n"}
    ours = json.loads(log_batch_json("0" * 32, points, tags, {}))
    theirs = json.loads(message_to_json(LogBatch(
        run_id="0" * 32, metrics=[Metric(*p).to_proto() for p in points],
        tags=[RunTag(k, v).to_proto() for k, v in tags.items()])))
    for m in theirs["metrics"]:  # protobuf JSON writes int64 as strings; the server reads either
        m["timestamp"], m["step"] = int(m["timestamp"]), int(m["step"])
    assert ours == theirs


def test_server_killed_and_restarted_nothing_lost_or_duplicated(mlflow_server, tmp_path):
    """Through a real `mlflow server`: killed mid-run, restarted on the same port and database. The
    loop keeps logging during the outage (it never waits on the store) and every point arrives once."""
    uri = mlflow_server.uri
    run_id = new_run(uri)
    w = MetricWriter(run_id, make_sender(uri, request_timeout_s=5), tracking_uri=uri, spill_dir=tmp_path / "spill",
                     backoff_s=(0.1, 1.0))
    steps = 0

    def train(n):
        nonlocal steps
        for _ in range(n):
            w.log_metrics({"loss": 1.0 / (steps + 1), "grad/norm": float(steps % 7), "nan": float("nan")}, steps)
            steps += 1
            time.sleep(0.002)

    train(200)
    assert w.flush(timeout=60)
    mlflow_server.kill()
    delivered_before = w.stats.delivered
    train(300)  # all 300 steps are taken while the server is down
    assert steps == 500
    time.sleep(1.0)
    assert w.stats.delivered == delivered_before and w.stats.send_failures > 0
    mlflow_server.start()
    train(100)
    stats = w.close(timeout=120)
    assert stats.undelivered == 0
    got = history(uri, run_id, "loss")
    assert [s for s, _ in got] == list(range(600))  # nothing lost, nothing duplicated
    assert all(v == 1.0 / (s + 1) for s, v in got)
    nan = history(uri, run_id, "nan")
    assert len(nan) == 600 and all(math.isnan(v) for _, v in nan)  # NaN survives the REST path


@pytest.mark.server
def test_frozen_server_does_not_block_training(mlflow_server, tmp_path):
    """SIGSTOP: the server accepts connections and never answers. The loop still finishes its steps;
    after SIGCONT everything is delivered once."""
    uri = mlflow_server.uri
    run_id = new_run(uri)
    w = MetricWriter(run_id, make_sender(uri, request_timeout_s=2), tracking_uri=uri, spill_dir=tmp_path / "spill",
                     backoff_s=(0.1, 0.5))
    mlflow_server.signal(signal.SIGSTOP)
    try:
        done = threading.Event()

        def train():
            for step in range(300):
                w.log_metrics({"r": float(step)}, step)
            done.set()

        t = threading.Thread(target=train)
        t.start()
        assert done.wait(30), "the training thread blocked on a frozen server"
        assert w.stats.delivered == 0
    finally:
        mlflow_server.signal(signal.SIGCONT)
    stats = w.close(timeout=120)
    assert stats.undelivered == 0
    assert history(uri, run_id, "r") == [(s, float(s)) for s in range(300)]


def test_value_that_breaks_float_is_skipped_and_the_ingest_thread_goes_on(sqlite_uri, tmp_path, caplog):
    """An int past float's range (OverflowError; 10**5000 has no repr either) and a `__float__` that
    raises used to kill the ingest thread: close() then waited its whole timeout and miscounted."""

    class DeviceLost:
        def __float__(self):
            raise RuntimeError("CUDA error: device lost")

    run_id = new_run(sqlite_uri)
    w = MetricWriter(run_id, make_sender(sqlite_uri), tracking_uri=sqlite_uri, spill_dir=tmp_path / "spill")
    with caplog.at_level(logging.WARNING, logger="rldiag.writer"):
        for step in range(100):
            w.log_metrics({"ok": float(step), "huge": 10**5000 if step == 10 else 1.0,
                           "broken": DeviceLost() if step == 20 else 2.0}, step)
        t0 = time.monotonic()
        stats = w.close(timeout=60)
        took = time.monotonic() - t0
    assert w._threads[0].is_alive() is False and took < 30  # the ingest thread drained and stopped; no timeout
    assert (stats.enqueued, stats.rejected, stats.delivered, stats.undelivered) == (298, 2, 298, 0)
    assert history(sqlite_uri, run_id, "ok") == [(s, float(s)) for s in range(100)]
    assert [s for s, _ in history(sqlite_uri, run_id, "huge")] == [s for s in range(100) if s != 10]
    assert [s for s, _ in history(sqlite_uri, run_id, "broken")] == [s for s in range(100) if s != 20]
    assert "'huge' at step 10" in caplog.text and "OverflowError" in caplog.text and "<int>" in caplog.text
    assert "'broken' at step 20" in caplog.text and "device lost" in caplog.text
    assert "not delivered" not in caplog.text
    assert not journal_path(tmp_path / "spill", run_id).exists()


def test_after_close_flush_returns_and_logging_warns_once(sqlite_uri, tmp_path, caplog):
    run_id = new_run(sqlite_uri)
    w = MetricWriter(run_id, make_sender(sqlite_uri), tracking_uri=sqlite_uri, spill_dir=tmp_path / "spill")
    w.log_metrics({"a": 1.0}, 0)
    assert w.close(timeout=60).undelivered == 0
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(w.flush()), daemon=True)  # no timeout: used to block forever
    t.start()
    t.join(10)
    assert got == [True]
    with caplog.at_level(logging.WARNING, logger="rldiag.writer"):
        w.log_metrics({"a": 2.0, "b": 3.0}, 1)
        w.set_tags({"t": "x"})
        w.log_metrics({"a": 4.0}, 2)
    assert caplog.text.count("after the writer of run") == 1 and w.stats.after_close == 4
    assert history(sqlite_uri, run_id, "a") == [(0, 1.0)]

    # A flush waiting when close() gives up (the store down) is released with False, not left hanging.
    def down(run_id, metrics, tags):
        raise ConnectionError("store down")

    w2 = MetricWriter(new_run(sqlite_uri), down, spill_dir=tmp_path / "spill", backoff_s=(0.01, 0.05))
    w2.log_metrics({"a": 1.0}, 0)
    got2: list[bool] = []
    t2 = threading.Thread(target=lambda: got2.append(w2.flush()), daemon=True)
    t2.start()
    time.sleep(0.3)
    assert w2.close(timeout=1).undelivered == 1
    t2.join(10)
    assert got2 == [False] and w2.flush() is False


def test_points_the_store_takes_as_close_gives_up_are_counted_once(sqlite_uri, tmp_path):
    """close() gives up just after the store took a call and before the sender counted it (held there
    by a gate on its accounting: the moment a reply arrives as the timeout passes, which the team-load
    bench hit in 2 of 16 writers). The 3 points are counted undelivered, not also delivered, and the
    counts do not change after close() (before: delivered 3 + undelivered 3 of 3 logged). They stay in
    the journal, and the run's next start stores each once."""
    run_id = new_run(sqlite_uri)
    w = MetricWriter(run_id, make_sender(sqlite_uri), tracking_uri=sqlite_uri, spill_dir=tmp_path / "spill",
                     send_interval_s=0.0)
    reached, gate = threading.Event(), threading.Event()
    account = w._done

    def gated(n, **kw):  # the store has taken the call; hold the sender before it counts
        reached.set()
        gate.wait(30)
        account(n, **kw)

    w._done = gated
    w.log_metrics({"m": 1.0}, 0)
    w.log_metrics({"m": 2.0}, 1)
    w.log_metrics({"m": 3.0}, 2)
    assert reached.wait(30)
    stats = w.close(timeout=0.5)
    at_close = (stats.delivered, stats.undelivered)
    gate.set()
    w._threads[1].join(30)
    assert at_close == (0, 3)  # 3 logged: each counted once
    assert (stats.delivered, stats.undelivered) == (0, 3)  # and the close summary stays as it said
    assert history(sqlite_uri, run_id, "m") == [(0, 1.0), (1, 2.0), (2, 3.0)]  # the store has them
    again = MetricWriter(run_id, make_sender(sqlite_uri), tracking_uri=sqlite_uri, spill_dir=tmp_path / "spill")
    assert again.close(timeout=60).replayed == 3
    assert history(sqlite_uri, run_id, "m") == [(0, 1.0), (1, 2.0), (2, 3.0)]  # once each after the replay
