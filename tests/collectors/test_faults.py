"""Faults and bad input that a long training job meets: each gets a clear answer and nothing logged is lost.

(The server killed/frozen, SIGKILLed training and torn journals are in test_writer.py; bad metric
values and keys too. Here: a full disk, steps out of order, oversize params, unicode and HTML names,
and several processes on one SQLite file.)
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from mlflow import MlflowClient

from rldiag.app.data.histories import load_histories
from rldiag.app.data.runs import find_runs
from rldiag.app.data.store import open_store
from rldiag.app.errors import ExperimentNotFound, NoRunsFound
from rldiag.collectors import Monitor
from rldiag.collectors.journal import journal_path
from rldiag.collectors.mlflow_store import MAX_PARAM_CHARS, make_sender, open_run
from rldiag.collectors.writer import MetricWriter


def _new_run(uri: str, name: str = "faults") -> str:
    return open_run(uri, experiment="faults", run_name=name)[1].info.run_id


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux) to stand for a full disk")
def test_full_disk_for_the_journal_is_one_clear_warning_and_metrics_still_arrive(sqlite_uri, tmp_path, caplog):
    run_id = _new_run(sqlite_uri)
    spill = tmp_path / "spill"
    spill.mkdir()
    journal_path(spill, run_id).symlink_to("/dev/full")  # every write: ENOSPC, as on a full disk
    with caplog.at_level(logging.WARNING, logger="rldiag.writer"):
        w = MetricWriter(run_id, make_sender(sqlite_uri), tracking_uri=sqlite_uri, spill_dir=spill)
        for step in range(50):
            w.log_metrics({"loss": float(step)}, step)
        stats = w.close(timeout=60)
    assert stats.journal_errors >= 1 and stats.undelivered == 0
    assert "cannot write the local journal" in caplog.text and "No space left" in caplog.text
    assert caplog.text.count("cannot write the local journal") == 1  # said once, not per batch
    hist = MlflowClient(sqlite_uri).get_metric_history(run_id, "loss")
    assert sorted(m.step for m in hist) == list(range(50))


def test_steps_out_of_order_and_repeated_read_back_once_per_step(sqlite_uri):
    run_id = _new_run(sqlite_uri)
    w = MetricWriter(run_id, make_sender(sqlite_uri), tracking_uri=sqlite_uri, spill_dir=None)
    # 5, 3, then 3 again with a later timestamp (a resumed run re-logging it), 4, and 0 last
    for step, value, ts in [(5, 5.0, 1005), (3, 3.0, 1003), (3, 33.0, 2003), (4, 4.0, 1004), (0, 0.0, 1000)]:
        w.log_metrics({"loss": value}, step, timestamp_ms=ts)
    assert w.close(timeout=60).undelivered == 0
    assert len(MlflowClient(sqlite_uri).get_metric_history(run_id, "loss")) == 5  # the store keeps every row
    t = load_histories(open_store(sqlite_uri), [run_id], ["loss"]).get(run_id, "loss")
    assert t.steps.tolist() == [0, 3, 4, 5]  # ascending, one point per step
    assert t.values.tolist() == [0.0, 33.0, 4.0, 5.0]  # the repeated step shows its latest value


def test_oversize_params_unicode_and_html_names_are_kept_as_text(sqlite_uri, caplog):
    name = "α/β 学习 🚀 <img src=x onerror=alert(1)>"
    long = "x" * (MAX_PARAM_CHARS + 500)
    with caplog.at_level(logging.WARNING):
        with Monitor("faults ✓", run_name=name, tracking_uri=sqlite_uri, tags={"note": "<b>bold</b>"},
                     params={"prompt": long, "ok": 1}) as mon:
            mon.log({"loss": 1.0}, 0)
            run_id = mon.run_id
    run = MlflowClient(sqlite_uri).get_run(run_id)
    assert run.info.run_name == name and run.data.tags["note"] == "<b>bold</b>"
    assert len(run.data.params["prompt"]) == MAX_PARAM_CHARS and run.data.params["ok"] == "1"
    assert "prompt" in caplog.text  # the warning names the param that was cut
    runs = find_runs(open_store(sqlite_uri), experiments="faults ✓")
    assert runs["name"].tolist() == [name]


WRITER = textwrap.dedent("""
    import sys
    from rldiag.collectors.mlflow_store import make_sender, open_run
    from rldiag.collectors.writer import MetricWriter
    uri, name, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    _, run = open_run(uri, experiment="shared-file", run_name=name)
    w = MetricWriter(run.info.run_id, make_sender(uri), tracking_uri=uri, spill_dir=None)
    for s in range(steps):
        w.log_metrics({f"m{i}": float(s + i) for i in range(8)}, s)
    st = w.close(timeout=120)
    print(run.info.run_id, st.delivered, st.undelivered)
""")


@pytest.mark.slow
def test_two_writer_processes_and_a_reader_on_one_sqlite_file(sqlite_uri, tmp_path):
    MlflowClient(sqlite_uri).search_experiments()  # migrate once, before the processes race to
    steps = 600
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, sqlite_uri, f"w{i}", str(steps)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    reads, errors, h = 0, [], None
    deadline = time.monotonic() + 300
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        try:  # the dashboard's reads, as often as it can, while both write
            runs = find_runs(open_store(sqlite_uri), experiments="shared-file")
            if len(runs):
                h = load_histories(open_store(sqlite_uri), runs["run_id"].tolist(), ["m0", "m7"], previous=h)
            reads += 1
        except (ExperimentNotFound, NoRunsFound):
            pass  # the writers have not created it yet
        except Exception as e:  # noqa: BLE001 - any other error here is what the test looks for
            errors.append(f"{type(e).__name__}: {e}")
        time.sleep(0.05)
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert "locked" not in err.lower(), err
    assert errors == [] and reads > 5
    ids = [out.split()[0] for out, _ in outs]
    assert [out.split()[1:] for out, _ in outs] == [[str(steps * 8), "0"]] * 2  # delivered, undelivered
    final = load_histories(open_store(sqlite_uri), ids, ["m0", "m7"])
    for rid in ids:
        assert final.get(rid, "m7").steps.tolist() == list(range(steps))
        np.testing.assert_array_equal(final.get(rid, "m7").values, np.arange(steps) + 7.0)


def test_refused_param_name_leaves_no_running_run_and_names_the_fix(sqlite_uri):
    from rldiag.collectors.mlflow_store import InvalidNameError, TrackingStoreError
    from rldiag.collectors.session import RunSession

    with pytest.raises(InvalidNameError) as e:
        RunSession("names", tracking_uri=sqlite_uri, params={"lr schedule!": "cosine", "opt": {"b(1)": 0.9}, "ok": 1})
    msg = str(e.value)
    assert "param 'lr schedule!'" in msg and "'lr schedule_'" in msg and "param 'opt.b(1)'" in msg
    assert "no run was created" in msg and "Rename them" in msg
    client = MlflowClient(sqlite_uri)
    exps = [x.experiment_id for x in client.search_experiments()]
    assert client.search_runs(exps) == []

    # A resumed run whose params the store refuses (a changed value) keeps its status: not left RUNNING.
    _, run = open_run(sqlite_uri, experiment="names", run_name="r", params={"lr": 0.1})
    client.set_terminated(run.info.run_id, "FINISHED")
    with pytest.raises(TrackingStoreError, match=r"refused to open the run: .*lr"):
        open_run(sqlite_uri, experiment="names", run_id=run.info.run_id, params={"lr": 0.2})
    assert client.get_run(run.info.run_id).info.status == "FINISHED"
    assert [r.info.status for r in client.search_runs(exps + [run.info.experiment_id])] == ["FINISHED"]


@pytest.mark.server
def test_credentials_never_stored_or_shown_close_is_bounded_and_sync_finds_them(mlflow_server, tmp_path, caplog,
                                                                                  monkeypatch, capsys):
    """A tracking URI with a password, through a real `mlflow server` that is killed mid-run: the
    journal (0600, in a 0700 folder) and every error keep the password out; close() returns within its
    timeout although MLflow's client retries ending the run for minutes; `rldiag sync` takes the
    credentials from MLFLOW_TRACKING_URI, and says in one line when nothing gives them."""
    import shutil

    from rldiag.app.cli.main import main
    from rldiag.collectors.journal import read_journal
    from rldiag.collectors.session import RunSession
    from rldiag.collectors.settings import MLFLOW_CREDENTIAL_VARS
    from rldiag.collectors.sync import journal_tracking_uri

    monkeypatch.chdir(tmp_path)
    for v in ("MLFLOW_TRACKING_URI", *MLFLOW_CREDENTIAL_VARS):
        monkeypatch.delenv(v, raising=False)
    secret = "s3cret-Pa55"
    uri = f"http://alice:{secret}@127.0.0.1:{mlflow_server.port}"
    spill = tmp_path / "spill"
    timeout = 4.0
    with caplog.at_level(logging.INFO):
        s = RunSession("secrets", run_name="creds", tracking_uri=uri, spill_dir=spill, close_timeout_s=timeout)
        s.writer.log_metrics({"m": 0.0}, 0)
        assert s.writer.flush(60)
        mlflow_server.kill()
        for step in range(1, 50):
            s.writer.log_metrics({"m": float(step)}, step)
        time.sleep(1.0)  # the sender tries, and MLflow's error quotes the URL it called
        t0 = time.monotonic()
        stats = s.close()
        took = time.monotonic() - t0
    assert took < timeout + 1.5  # set_terminated, which MLflow retries for minutes, is not waited for
    assert stats.undelivered == 49 and stats.send_failures > 0
    assert "alice:***@127.0.0.1" in stats.last_error and secret not in stats.last_error
    assert secret not in caplog.text and "49 metric points" in caplog.text
    path = journal_path(spill, s.run_id)
    assert os.stat(path).st_mode & 0o777 == 0o600 and os.stat(spill).st_mode & 0o777 == 0o700
    text = path.read_text()
    assert secret not in text and '"tracking_uri":"http://alice:***@127.0.0.1' in text

    contents = read_journal(path)
    bare = f"http://127.0.0.1:{mlflow_server.port}"
    assert contents.uri_redacted and journal_tracking_uri(contents, f"{bare}/") == (f"{bare}/", None)
    uri_used, note = journal_tracking_uri(contents)
    assert uri_used == bare and "had credentials" in note and secret not in note

    mlflow_server.start()
    copy = tmp_path / "copy.jsonl"
    shutil.copy(path, copy)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    assert journal_tracking_uri(read_journal(copy)) == (uri, None)
    capsys.readouterr()
    assert main(["sync", str(copy)]) == 0
    out = capsys.readouterr().out
    assert "had credentials" not in out and secret not in out and "delivered" in out
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert main(["sync", str(path)]) == 0  # this server takes it without credentials too
    out = capsys.readouterr().out
    assert out.count("had credentials") == 1 and secret not in out
    got = MlflowClient(bare).get_metric_history(s.run_id, "m")
    assert sorted(m.step for m in got) == list(range(50))  # each once, though both journals were replayed
