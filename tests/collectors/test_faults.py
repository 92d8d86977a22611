"""Faults and bad input that a long training job meets: each gets a clear answer and nothing logged is lost.

(The server killed/frozen, SIGKILLed training and torn journals are in test_writer.py; bad metric
values and keys too. Here: a full disk, steps out of order, oversize params, unicode and HTML names,
and several processes on one SQLite file.)
"""

from __future__ import annotations

import logging
import os
import signal
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


def test_full_disk_for_the_journal_is_one_clear_warning_and_metrics_still_arrive(sqlite_uri, small_fs, caplog):
    """The spill folder on a real tmpfs that is full before the run starts: one warning, every point
    delivered (the store is up), and nothing of the user's on that disk changes."""
    run_id = _new_run(sqlite_uri)
    small_fs.fill()
    spill = small_fs.root / "spill"
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
    with caplog.at_level(logging.WARNING), Monitor("faults ✓", run_name=name, tracking_uri=sqlite_uri,
                                                   tags={"note": "<b>bold</b>"}, params={"prompt": long, "ok": 1}) as mon:
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


# ---- faults combined: every point stored exactly once ---------------------------------------------
KILLS_KEYS = [f"k{i:02d}" for i in range(50)]


def _kill_values(step: int) -> dict[str, float]:
    v = {k: step + i / 100 for i, k in enumerate(KILLS_KEYS)}
    if step == 333:
        v["k00"] = float("nan")  # the NaN step is the one that must not go missing
    return v


@pytest.mark.slow
@pytest.mark.server
def test_five_server_kills_in_one_run_every_point_once(mlflow_server, tmp_path, capsys):
    """A real `mlflow server` SIGKILLed five times while the loop logs 50 keys a step (a NaN at step
    333), restarted each time on the same port and database; a RAM cap of 2000 entries, so each outage's
    backlog is also read back from the journal. Every one of the 50 keys at every step is stored once."""
    uri = mlflow_server.uri
    run_id = _new_run(uri, "five-kills")
    w = MetricWriter(run_id, make_sender(uri, request_timeout_s=5), tracking_uri=uri, spill_dir=tmp_path / "spill",
                     backoff_s=(0.1, 1.0), backlog_points=2000)
    step = 0
    for _ in range(5):
        for _ in range(40):  # the server up
            w.log_metrics(_kill_values(step), step)
            step += 1
            time.sleep(0.005)
        mlflow_server.kill()
        for _ in range(80):  # the server down: all of these wait, in memory then in the journal
            w.log_metrics(_kill_values(step), step)
            step += 1
            time.sleep(0.005)
        time.sleep(0.5)
        mlflow_server.start()
    for _ in range(20):
        w.log_metrics(_kill_values(step), step)
        step += 1
    stats = w.close(timeout=300)
    assert step == 620 and stats.undelivered == 0 and stats.lost == 0 and stats.send_failures >= 5
    assert stats.spilled > 0  # 80 steps x 50 keys = 4000 a backlog, cap 2000
    client = MlflowClient(uri)
    stored = 0
    for k in KILLS_KEYS:
        hist = client.get_metric_history(run_id, k)
        assert sorted(m.step for m in hist) == list(range(620)), k  # none lost, none twice
        stored += len(hist)
    nan = [m for m in client.get_metric_history(run_id, "k00") if m.step == 333]
    assert len(nan) == 1 and np.isnan(nan[0].value)
    with capsys.disabled():
        print(f"\nfive server kills: {stored} of {620 * 50} points stored once, {stats.send_failures} failed calls, "
              f"{stats.spilled} entries read back from the journal")


SIGKILLED = textwrap.dedent("""
    import sys, time
    from rldiag.collectors import Monitor
    uri, run_id, first, last = sys.argv[1], sys.argv[2] or None, int(sys.argv[3]), int(sys.argv[4])
    mon = Monitor("sigkill", run_name="sigkill", run_id=run_id, tracking_uri=uri, spill_dir="spill")
    print("run", mon.run_id, flush=True)
    for step in range(first, last):
        mon.log({f"k{i}": step + i / 10 for i in range(20)}, step)
        print("logged", step, flush=True)
        time.sleep(0.003)
    mon.close()
    print("closed", flush=True)
""")


def test_sigkill_of_the_training_process_then_restart_with_the_same_run_id(sqlite_uri, tmp_path, capsys):
    """The training process (Monitor, 20 keys a step, SQLite) is SIGKILLed mid-run; a new process
    resumes the run id. Every point that was delivered or in the journal at the kill is stored after
    the restart, once; what was printed as logged but not yet journaled (the last ingest window, about
    50 ms) is the only loss, and it is measured."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen([sys.executable, "-c", SIGKILLED, sqlite_uri, "", "0", "100000"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    printed = -1
    try:
        run_id = proc.stdout.readline().split()[1]
        for line in proc.stdout:
            if line.startswith("logged"):
                printed = int(line.split()[1])
                if printed == 600:
                    proc.kill()
                    break
    finally:
        proc.kill()
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL and printed == 600
    from rldiag.collectors.journal import read_journal

    client = MlflowClient(sqlite_uri)
    delivered = {(m.step, k) for k in ("k0", "k19") for m in client.get_metric_history(run_id, k)}
    journaled = {(p[3], p[0]) for b in read_journal(journal_path(tmp_path / "spill", run_id)).pending
                 for p in b.metrics if p[0] in ("k0", "k19")}
    assert journaled, "the kill should leave undelivered points in the journal (send interval 1 s)"
    out = subprocess.run([sys.executable, "-c", SIGKILLED, sqlite_uri, run_id, "2000", "2010"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0 and "closed" in out.stdout, out.stderr
    for k in ("k0", "k19"):
        steps = [m.step for m in client.get_metric_history(run_id, k)]
        assert len(steps) == len(set(steps))  # once each
        before = {s for s in steps if s < 2000}
        assert before == {s for s, kk in delivered | journaled if kk == k}  # all of it, nothing else
        assert before == set(range(max(before) + 1))  # a prefix of what was logged: no hole
        assert set(steps) - before == set(range(2000, 2010))
    stored = len(before)
    assert stored >= printed + 1 - 100  # at most the last ingest window's steps are lost (~50 ms, 3 ms a step)
    with capsys.disabled():
        print(f"\nSIGKILL + restart: {stored} of {printed + 1} printed steps stored (x20 keys), "
              f"{len(journaled) // 2} of them replayed from the journal")
