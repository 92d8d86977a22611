"""The outage backlog has a RAM cap: past it, batches wait in the journal and are read back from there.

Against a real `mlflow server` killed and restarted, and a SQLite store made unreachable (the sender
fails as a stopped store does): with a tiny cap every point arrives once after the store returns,
NaN, inf flags and alert tags included, and the memory backlog never grows past the cap.
"""

from __future__ import annotations

import logging
import math
import time

import pytest
from mlflow import MlflowClient

from rldiag.collectors import keys
from rldiag.collectors.journal_read import segment_files
from rldiag.collectors.mlflow_store import make_sender, open_run
from rldiag.collectors.writer import MetricWriter
from tests.helpers.writer import RamWatch

MAX_FLOAT = 1.7976931348623157e308


def new_run(uri: str) -> str:
    return open_run(uri, experiment="backlog-tests", run_name="b")[1].info.run_id


def history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, key))


class Down:
    """A sender that fails as a stopped store does (connection refused) until `up` is set."""

    def __init__(self, send):
        self.send, self.up = send, False

    def __call__(self, run_id, metrics, tags):
        if not self.up:
            raise ConnectionRefusedError(111, "Connection refused")
        self.send(run_id, metrics, tags)


def values(step: int) -> dict[str, float]:
    v = {f"m{i}": step * 10.0 + i for i in range(8)}
    if step == 150:
        v["m0"] = float("nan")
        v["m1"] = float("inf")
    return v


def check_every_point_once(uri: str, run_id: str, steps: int) -> None:
    for i in range(8):
        got = history(uri, run_id, f"m{i}")
        assert [s for s, _ in got] == list(range(steps)), f"m{i}"  # each step once: none lost, none twice
        for s, v in got:
            want = values(s)[f"m{i}"]
            if math.isinf(want):  # MLflow's SQL store keeps inf as max-float; the flag says which it was
                assert v in (want, MAX_FLOAT)
            else:
                assert (math.isnan(v) and math.isnan(want)) or v == want
    assert history(uri, run_id, keys.inf_flag_key("m1")) == [(150, 1.0)]


def test_tiny_cap_outage_on_sqlite_every_point_read_back_from_the_journal(sqlite_uri, tmp_path, caplog):
    """Cap 100 entries, 4 KiB segments; the store is down for 300 steps x 8 keys (2400 points, a NaN,
    an inf and 3 alert tags among them): the backlog waits in the journal (a few hundred points at most
    in memory), and after the store returns every point is stored once."""
    run_id = new_run(sqlite_uri)
    send = Down(make_sender(sqlite_uri))
    spill = tmp_path / "spill"
    w = MetricWriter(run_id, send, tracking_uri=sqlite_uri, spill_dir=spill, backlog_points=100,
                     segment_bytes=4096, backoff_s=(0.02, 0.1))
    watch = RamWatch(w)
    with caplog.at_level(logging.WARNING, logger="rldiag.writer"):
        for step in range(300):
            w.log_metrics(values(step), step)
            if step == 150:  # what the alert sink sets on a NaN step
                w.set_tags({keys.TAG_ALERT_COUNT: "1", keys.TAG_ALERT_FIRST_STEP: "150",
                            keys.TAG_ALERT_LAST: '{"step": 150}'})
        time.sleep(1.0)
        assert len(segment_files(spill, run_id)) >= 2  # ~2400 x 30 bytes in batches of up to 1000: on disk
        send.up = True
        assert w.flush(120)
    stats = w.close(timeout=60)
    peak = watch.stop()
    assert stats.undelivered == 0 and stats.lost == 0
    assert stats.spilled > 2000  # nearly all of it waited in the journal, not in memory
    assert peak <= 100  # a batch goes to memory only if it fits under the cap
    assert caplog.text.count("waits in the journal") == 1
    check_every_point_once(sqlite_uri, run_id, 300)
    tags = MlflowClient(sqlite_uri).get_run(run_id).data.tags
    assert tags[keys.TAG_ALERT_FIRST_STEP] == "150"
    assert segment_files(spill, run_id) == []


@pytest.mark.server
def test_tiny_cap_server_killed_and_restarted_every_point_arrives(mlflow_server, tmp_path):
    """A real `mlflow server` SIGKILLed mid-run and restarted on the same port and database; cap 200."""
    uri = mlflow_server.uri
    run_id = new_run(uri)
    w = MetricWriter(run_id, make_sender(uri, request_timeout_s=5), tracking_uri=uri, spill_dir=tmp_path / "spill",
                     backlog_points=200, segment_bytes=8192, backoff_s=(0.1, 1.0))
    watch = RamWatch(w)
    for step in range(100):
        w.log_metrics(values(step), step)
    assert w.flush(60)
    mlflow_server.kill()
    for step in range(100, 400):
        w.log_metrics(values(step), step)
        time.sleep(0.002)
    time.sleep(1.0)
    assert w.stats.spilled > 1500
    mlflow_server.start()
    for step in range(400, 450):
        w.log_metrics(values(step), step)
    stats = w.close(timeout=180)
    peak = watch.stop()
    assert stats.undelivered == 0 and stats.lost == 0 and stats.send_failures > 0
    assert peak <= 200
    check_every_point_once(uri, run_id, 450)
