"""The training process SIGKILLed while its journal rolls to a new segment, then restarted with the same run id,
with files of the user's in the spill folder: every point that was delivered or journaled at the kill is
stored once, with no hole; the restarted writer's books balance; the user's files are byte-identical."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from mlflow import MlflowClient

from rldiag.collectors.journal import journal_path, read_journal
from rldiag.collectors.journal_read import read_header, segment_files

ROLLING = textwrap.dedent("""
    import sys, time
    from rldiag.collectors.mlflow_store import make_sender, open_run
    from rldiag.collectors.writer import MetricWriter
    uri, run_id, first, last = sys.argv[1], sys.argv[2] or None, int(sys.argv[3]), int(sys.argv[4])
    client, run = open_run(uri, experiment="roll", run_name="roll", run_id=run_id)
    # segments of 2 KB (about 2 batches): the journal rolls every few steps
    w = MetricWriter(run.info.run_id, make_sender(uri), tracking_uri=uri, spill_dir="spill", segment_bytes=2048)
    print("run", run.info.run_id, flush=True)
    for step in range(first, last):
        w.log_metrics({f"k{i}": step + i / 10 for i in range(20)}, step)
        time.sleep(0.002)
    stats = w.close(timeout=120)
    print("closed", stats.balance(), stats.undelivered, stats.ledger(), flush=True)
""")
FOREIGN = {"alerts.jsonl": '{"event": "nonfinite_grad", "step": 3}\n', "my_eval_results.jsonl": '{"acc": 0.5}\n'}


def _digest(folder: Path) -> dict[str, str]:
    return {n: hashlib.sha256((folder / n).read_bytes()).hexdigest() for n in FOREIGN}


def test_sigkill_during_a_segment_roll_then_restart(sqlite_uri, tmp_path):
    spill = tmp_path / "spill"
    spill.mkdir()
    for name, text in FOREIGN.items():
        (spill / name).write_text(text)
    before = _digest(spill)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen([sys.executable, "-c", ROLLING, sqlite_uri, "", "0", "1000000"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        run_id = proc.stdout.readline().split()[1]
        newest, deadline = 0, time.monotonic() + 240
        while time.monotonic() < deadline:  # kill the moment a new segment appears: mid-roll
            numbers = [n for n, _ in segment_files(spill, run_id)]
            if numbers and max(numbers) > newest:
                if newest >= 3:
                    proc.send_signal(signal.SIGKILL)
                    break
                newest = max(numbers)
            time.sleep(0.0005)
    finally:
        proc.kill()
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL and newest >= 3, (newest, proc.stderr.read()[-2000:])

    client = MlflowClient(sqlite_uri)
    delivered = {m.step for m in client.get_metric_history(run_id, "k7")}
    journaled = {p[3] for b in read_journal(journal_path(spill, run_id)).pending for p in b.metrics if p[0] == "k7"}
    assert journaled, "the kill should leave points in the journal (the writer sends once a second)"

    out = subprocess.run([sys.executable, "-c", ROLLING, sqlite_uri, run_id, "5000000", "5000010"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    closed = next(line.split() for line in out.stdout.splitlines() if line.startswith("closed"))
    assert closed[1:3] == ["0", "0"], out.stdout  # balance 0, nothing undelivered: the replay went through
    for key in ("k0", "k7", "k19"):
        steps = [m.step for m in client.get_metric_history(run_id, key)]
        assert len(steps) == len(set(steps)), key  # once each
        old = {s for s in steps if s < 5_000_000}
        assert old == delivered | journaled, key  # everything delivered or journaled at the kill, nothing else
        assert old == set(range(max(old) + 1)), key  # no hole
    assert not segment_files(spill, run_id)  # every segment acknowledged, then removed
    assert _digest(spill) == before and sorted(p.name for p in spill.iterdir() if p.suffix == ".jsonl") == sorted(
        FOREIGN)


# The same writer, SIGKILLed by its own hand halfway through the header of its 3rd segment: the one moment of
# a roll the timed kill above lands in only now and then (CI once: segment 4 left headerless, as foreign).
HALF_HEADER = textwrap.dedent("""
    import os, signal, sys
    import rldiag.collectors.journal_files as journal_files
    real = journal_files.write_all
    def write_all(fd, data):
        if data.startswith(b'{"rldiag_journal"') and b'"segment":3' in data:
            os.write(fd, data[: len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        real(fd, data)
    journal_files.write_all = write_all
    exec(sys.argv.pop(1))
""")


def _killed_halfway(sqlite_uri: str, tmp_path: Path) -> tuple[Path, dict, str]:
    """A rolling writer run until it kills itself halfway through its 3rd segment's header: (spill, env, run id)."""
    spill = tmp_path / "spill"
    spill.mkdir()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    killed = subprocess.run([sys.executable, "-c", HALF_HEADER, ROLLING, sqlite_uri, "", "0", "1000000"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    return spill, env, killed.stdout.split()[1]


def test_sigkill_halfway_through_a_new_segments_header(sqlite_uri, tmp_path):
    spill, env, run_id = _killed_halfway(sqlite_uri, tmp_path)
    # no file named like a segment without its whole header: segment 3, half its header written, has no name
    segments = segment_files(spill, run_id)
    assert segments and max(n for n, _ in segments) == 2, os.listdir(spill)
    assert all(read_header(p)[1] is None for _, p in segments)
    journaled = {p[3] for b in read_journal(journal_path(spill, run_id)).pending for p in b.metrics if p[0] == "k7"}
    delivered = {m.step for m in MlflowClient(sqlite_uri).get_metric_history(run_id, "k7")}

    out = subprocess.run([sys.executable, "-c", ROLLING, sqlite_uri, run_id, "5000000", "5000010"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    closed = next(line.split() for line in out.stdout.splitlines() if line.startswith("closed"))
    assert closed[1:3] == ["0", "0"], out.stdout
    steps = {m.step for m in MlflowClient(sqlite_uri).get_metric_history(run_id, "k7")}
    assert {s for s in steps if s < 5_000_000} == delivered | journaled == set(range(max(journaled | delivered) + 1))
    assert not segment_files(spill, run_id) and not [p for p in spill.iterdir() if p.name.endswith(".jsonl")]
    assert sorted(p.name for p in spill.iterdir()) == []  # nor the hidden header file, nor a lock


def test_rldiag_sync_after_a_kill_halfway_through_a_header_leaves_nothing(sqlite_uri, tmp_path, capsys):
    """No restart: `rldiag sync` delivers the journal and removes the hidden header file the kill left too."""
    from rldiag.app.cli.main import main
    from rldiag.collectors.journal_files import header_tmp

    spill, _, run_id = _killed_halfway(sqlite_uri, tmp_path)
    assert header_tmp(spill, run_id).exists()  # half a header, under the hidden name only
    journaled = {p[3] for b in read_journal(journal_path(spill, run_id)).pending for p in b.metrics if p[0] == "k7"}
    assert main(["sync", str(spill), "--tracking-uri", sqlite_uri]) == 0, capsys.readouterr().out
    steps = {m.step for m in MlflowClient(sqlite_uri).get_metric_history(run_id, "k7")}
    assert journaled <= steps == set(range(max(steps) + 1))
    assert sorted(os.listdir(spill)) == []
