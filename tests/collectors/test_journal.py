"""The journal has one owner at a time and stays bounded: real processes, a real SQLite store.

- `rldiag sync` on a live run's journal skips it in one line and leaves it whole (before: it replayed
  it and deleted the file the live writer went on appending to);
- two writers with one run id journal apart (before: they shared one file and numbering, one's acks
  marked the other's batches delivered: a replay recovered 14 of 50);
- delivered segments are deleted while the run goes on; a restart reads back only undelivered batches,
  and never parses an acknowledged one; a journal of rldiag before segments is still read.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from rldiag.app.cli.main import main
from rldiag.collectors import journal_read
from rldiag.collectors import writer as writer_mod
from rldiag.collectors.journal import Journal, JournalBusy, journal_path, read_journal
from rldiag.collectors.journal_lock import try_lock
from rldiag.collectors.journal_read import lock_path, segment_files
from rldiag.collectors.mlflow_store import make_sender, open_run
from rldiag.collectors.writer import MetricWriter

REPO = Path(__file__).resolve().parents[2]


def new_run(uri: str, name: str = "j") -> str:
    return open_run(uri, experiment="journal-tests", run_name=name)[1].info.run_id


def history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, key))


def spawn(script: str, *args: str, cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "MLFLOW_DISABLE_TELEMETRY": "true"}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script), *args], cwd=cwd, env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def expect(proc: subprocess.Popen, word: str) -> str:
    """The child's next stdout line, which must start with `word`."""
    line = proc.stdout.readline()
    if not line.startswith(word):
        proc.kill()
        raise AssertionError(f"expected {word!r} from the child, got {line!r}; stderr: {proc.stderr.read()[-3000:]}")
    return line.strip()


# A writer that holds its points: send_interval 1 h and fewer than max_batch points pending, so nothing
# is sent until the test says; "journaled N" once its own journal holds N points.
HOLDING_WRITER = """
    import os, sys, time
    from rldiag.collectors.journal import read_journal
    from rldiag.collectors.mlflow_store import make_sender
    from rldiag.collectors.writer import MetricWriter
    uri, run_id, key = sys.argv[1], sys.argv[2], sys.argv[3]
    w = MetricWriter(run_id, make_sender(uri), tracking_uri=uri, spill_dir="spill", send_interval_s=3600)
    print("open", os.getpid(), w.journal.path, flush=True)
    logged = 0
    for line in sys.stdin:
        cmd, n = line.split()
        if cmd == "log":
            for _ in range(int(n)):
                w.log_metrics({key: float(logged)}, logged)
                logged += 1
            while sum(len(b.metrics) for b in read_journal(w.journal.path).pending) < logged:
                time.sleep(0.02)
            print("journaled", logged, flush=True)
        elif cmd == "close":
            st = w.close(timeout=120)
            print("closed", st.delivered, st.undelivered, flush=True)
"""


def test_sync_on_a_live_run_skips_it_and_the_run_keeps_every_point(sqlite_uri, tmp_path, capsys):
    """The live writer holds 100 undelivered points; `rldiag sync` of its journal says it skipped it
    (naming the writer's pid) and touches nothing; the writer logs 100 more and is SIGKILLed; a restart
    of the run delivers all 200 once. Before the lock, sync delivered the 100 and deleted the journal,
    so the next 100 went into a deleted file and the restart found nothing: 100 of 200."""
    run_id = new_run(sqlite_uri)
    w = spawn(HOLDING_WRITER, sqlite_uri, run_id, "loss", cwd=tmp_path)
    try:
        _, pid, path = expect(w, "open").split()
        w.stdin.write("log 100\n")
        w.stdin.flush()
        expect(w, "journaled 100")
        before = Path(path).read_bytes()
        capsys.readouterr()
        assert main(["sync", path]) == 0  # nothing failed: the journal's own writer delivers it
        out = capsys.readouterr().out.strip().splitlines()
        assert len(out) == 1 and out[0].startswith(f"{path}: skipped: held by a live writer (pid {pid} on host ")
        assert Path(path).read_bytes() == before  # neither replayed (no acks written) nor removed
        assert history(sqlite_uri, run_id, "loss") == []
        w.stdin.write("log 100\n")
        w.stdin.flush()
        expect(w, "journaled 200")
    finally:
        w.kill()
        w.wait(30)
    assert w.returncode == -signal.SIGKILL
    restart = MetricWriter(run_id, make_sender(sqlite_uri), tracking_uri=sqlite_uri, spill_dir=tmp_path / "spill")
    stats = restart.close(timeout=120)
    assert stats.replayed == 200 and stats.undelivered == 0
    assert history(sqlite_uri, run_id, "loss") == [(s, float(s)) for s in range(200)]  # each once
    assert segment_files(tmp_path / "spill", run_id) == []  # delivered: removed


def test_two_writers_with_one_run_id_journal_apart_and_every_point_arrives(sqlite_uri, tmp_path):
    """Writer A holds the run's journal; writer B starts for the same run id, is told (one line naming
    A's pid) that it journals to `<run_id>-2`, journals 50 points and is SIGKILLed before sending; A
    logs and delivers its own 50 and closes. A restart of the run takes over B's journal: all 100
    points arrive, each once (before: one shared file, A's acks covered B's batch numbers)."""
    run_id = new_run(sqlite_uri)
    a = spawn(HOLDING_WRITER, sqlite_uri, run_id, "a", cwd=tmp_path)
    b = None
    try:
        _, pid_a, path_a = expect(a, "open").split()
        b = spawn(HOLDING_WRITER, sqlite_uri, run_id, "b", cwd=tmp_path)  # while A holds the journal
        _, _, path_b = expect(b, "open").split()
        assert Path(path_a).name == f"{run_id}.jsonl" and Path(path_b).name == f"{run_id}-2.jsonl"
        b.stdin.write("log 50\n")
        b.stdin.flush()
        expect(b, "journaled 50")
        b.kill()
        err_b = b.communicate(timeout=30)[1]
        said = [x for x in err_b.splitlines() if "held by a live writer" in x]
        assert len(said) == 1 and f"(pid {pid_a} on host " in said[0] and f"{run_id}-2.jsonl" in said[0]
        a.stdin.write("log 50\nclose 0\n")
        a.stdin.flush()
        expect(a, "journaled 50")
        assert expect(a, "closed") == "closed 50 0"
    finally:
        for p in (a, b):
            if p is None:
                continue
            p.kill()
            p.wait(30)
    assert history(sqlite_uri, run_id, "a") == [(s, float(s)) for s in range(50)]
    assert history(sqlite_uri, run_id, "b") == []  # B never sent
    restart = MetricWriter(run_id, make_sender(sqlite_uri), tracking_uri=sqlite_uri, spill_dir=tmp_path / "spill")
    stats = restart.close(timeout=120)
    assert stats.replayed == 50 and stats.undelivered == 0
    assert history(sqlite_uri, run_id, "b") == [(s, float(s)) for s in range(50)]
    assert history(sqlite_uri, run_id, "a") == [(s, float(s)) for s in range(50)]  # still once
    assert os.listdir(tmp_path / "spill") == []  # both journals and their locks removed


def test_journal_lock_is_exclusive_survives_a_fork_and_dies_with_its_process(tmp_path):
    lk = lock_path(tmp_path, "r")
    held = try_lock(lk)
    assert held is not None and try_lock(lk) is None  # a second owner, even in this process, is refused
    pid = os.fork()
    if pid == 0:  # the child closes its copy; it must not unlock the parent's lock
        held.abandon()
        os._exit(0)
    os.waitpid(pid, 0)
    assert try_lock(lk) is None
    with pytest.raises(JournalBusy, match=r"held by a live writer \(pid \d+ on host "):
        Journal.for_file(tmp_path / "r.jsonl")
    held.release()
    again = try_lock(lk)
    assert again is not None
    again.release()


def test_delivered_segments_are_deleted_while_the_run_goes_on(sqlite_uri, tmp_path):
    """Segments of 8 KiB: after each flush only the segment being written is left, at most one segment
    plus one batch line; 600 steps x 5 keys (a point is about 30 bytes here, `["k1",12.1,<13 digits>,12]`:
    about 90 KB of journal lines) went through 10 segments or more."""
    run_id = new_run(sqlite_uri)
    spill = tmp_path / "spill"
    w = MetricWriter(run_id, make_sender(sqlite_uri), tracking_uri=sqlite_uri, spill_dir=spill,
                     segment_bytes=8192)
    peak = 0
    for step in range(600):
        w.log_metrics({f"k{i}": step + i / 10 for i in range(5)}, step)
        if step % 50 == 49:
            assert w.flush(60)
            files = segment_files(spill, run_id)
            assert len(files) == 1, files  # every earlier segment was acknowledged, so deleted
            peak = max(peak, files[0][1].stat().st_size)
    last = segment_files(spill, run_id)[0][0]
    stats = w.close(timeout=60)
    assert stats.undelivered == 0
    assert last >= 10  # 3000 points x ~30 bytes / 8 KiB = 11
    assert peak <= 8192 + 50 * 5 * 60  # a segment, plus the batch line that crossed its limit
    assert os.listdir(spill) == []
    assert history(sqlite_uri, run_id, "k4") == [(s, s + 0.4) for s in range(600)]


class Down:
    """A sender that fails as a stopped store does (connection refused) until `up` is set."""

    def __init__(self, send):
        self.send, self.up = send, False

    def __call__(self, run_id, metrics, tags):
        if not self.up:
            raise ConnectionRefusedError(111, "Connection refused")
        self.send(run_id, metrics, tags)


def test_restart_reads_back_only_undelivered_batches(sqlite_uri, tmp_path, monkeypatch):
    """1000 steps delivered, then the store goes down for 200 more and the writer closes: only the
    segments holding those 200 are left. The restart parses exactly their batches (counted through
    `read_batch`); the scan parses no batch line at all (counted through json.loads)."""
    run_id = new_run(sqlite_uri)
    spill = tmp_path / "spill"
    send = Down(make_sender(sqlite_uri))
    send.up = True
    w = MetricWriter(run_id, send, tracking_uri=sqlite_uri, spill_dir=spill, segment_bytes=16384,
                     backoff_s=(0.01, 0.05))
    for step in range(1000):
        w.log_metrics({"m": float(step), "n": -float(step)}, step)
        if step % 100 == 99:
            assert w.flush(60)
    send.up = False
    for step in range(1000, 1200):
        w.log_metrics({"m": float(step), "n": -float(step)}, step)
    time.sleep(0.5)  # journaled
    stats = w.close(timeout=1)
    assert stats.undelivered == 400
    left = segment_files(spill, run_id)
    pending = read_journal(left[0][1]).pending
    assert sum(b.size for b in pending) == 400
    # 200 steps x 2 points x ~45 bytes = 18 KB of lines: two 16 KiB segments at most, not the whole run's
    assert 1 <= len(left) <= 3 and sum(p.stat().st_size for _, p in left) < 3 * 16384

    parsed_lines: list[bytes] = []
    real_loads = journal_read._loads
    monkeypatch.setattr(journal_read, "_loads", lambda raw: parsed_lines.append(raw) or real_loads(raw))
    journal = Journal.for_run(spill, run_id, sqlite_uri)  # the restart's scan
    monkeypatch.setattr(journal_read, "_loads", real_loads)
    assert parsed_lines and not [x for x in parsed_lines if x.startswith(b'{"seq"')]  # headers and acks only

    parsed = {"batches": 0}
    real_read = writer_mod.read_batch

    def counting_read(f, offset):
        parsed["batches"] += 1
        return real_read(f, offset)

    monkeypatch.setattr(writer_mod, "read_batch", counting_read)
    restart = MetricWriter(run_id, make_sender(sqlite_uri), tracking_uri=sqlite_uri, journal=journal)
    stats = restart.close(timeout=60)
    assert parsed["batches"] == len(pending) and stats.replayed == 400 and stats.undelivered == 0
    assert history(sqlite_uri, run_id, "m") == [(s, float(s)) for s in range(1200)]


def test_journal_of_rldiag_before_segments_is_read_and_only_its_undelivered_batches_parsed(sqlite_uri, tmp_path,
                                                                                           monkeypatch):
    """Version 1: one file, batches without an entry count, acks in the same file. 300 batches acked,
    the last 5 not: a restart delivers exactly those 5 x 4 points, parses no acknowledged batch,
    writes its own batches into a new version-2 segment and removes the old file once delivered."""
    run_id = new_run(sqlite_uri)
    spill = tmp_path / "spill"
    spill.mkdir()
    path = journal_path(spill, run_id)
    lines = [{"rldiag_journal": 1, "run_id": run_id, "tracking_uri": sqlite_uri}]
    for seq in range(305):
        lines.append({"seq": seq, "m": [[f"k{i}", seq + i / 4, 1_700_000_000_000 + seq, seq] for i in range(4)]})
        if seq % 10 == 9 and seq < 300:
            lines.append({"ack": list(range(seq - 9, seq + 1))})
    path.write_text("".join(json.dumps(x, separators=(",", ":")) + "\n" for x in lines))
    assert len(read_journal(path).pending) == 5

    parsed: list[bytes] = []
    real = journal_read._loads
    monkeypatch.setattr(journal_read, "_loads", lambda raw: parsed.append(raw) or real(raw))
    journal = Journal.for_run(spill, run_id, sqlite_uri)  # the restart's scan
    monkeypatch.setattr(journal_read, "_loads", real)
    # only the 5 undelivered lines are parsed (older lines say no entry count: it is counted from them)
    assert sorted(json.loads(x)["seq"] for x in parsed if x.startswith(b'{"seq"')) == [300, 301, 302, 303, 304]
    w = MetricWriter(run_id, make_sender(sqlite_uri), tracking_uri=sqlite_uri, journal=journal)
    w.log_metrics({"k0": 1e6}, 305)
    assert w.flush(60)
    newest = segment_files(spill, run_id)[-1][1]
    assert newest.name == f"{run_id}.1.jsonl" and json.loads(newest.open().readline())["rldiag_journal"] == 2
    stats = w.close(timeout=60)
    assert stats.replayed == 20 and stats.undelivered == 0
    assert history(sqlite_uri, run_id, "k3") == [(s, s + 0.75) for s in range(300, 305)]  # only the unacked
    assert os.listdir(spill) == []


def test_sync_of_a_spill_folder_delivers_each_journal_once(sqlite_uri, tmp_path, capsys):
    """Two runs' journals, one of them in 3 segments (all undelivered: the store was down): `rldiag sync
    FOLDER` delivers both, one line each; naming two segments of one journal syncs it once."""
    spill = tmp_path / "spill"
    runs = [new_run(sqlite_uri, "r1"), new_run(sqlite_uri, "r2")]
    for run_id, seg in zip(runs, (1024, 1 << 20)):
        w = MetricWriter(run_id, Down(make_sender(sqlite_uri)), tracking_uri=sqlite_uri, spill_dir=spill,
                         segment_bytes=seg, backoff_s=(0.01, 0.05))
        for step in range(100):
            w.log_metrics({"x": float(step)}, step)
            if step % 40 == 39:
                time.sleep(0.2)  # separate batches, so that the small segments rotate
        time.sleep(0.3)
        assert w.close(timeout=1).undelivered == 100
    assert len(segment_files(spill, runs[0])) >= 3 and len(segment_files(spill, runs[1])) == 1
    capsys.readouterr()
    segs = [str(p) for _, p in segment_files(spill, runs[0])[:2]]
    assert main(["sync", *segs]) == 0  # two segments of one journal: synced once
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "delivered 100 points; journal removed" in out[0]
    assert main(["sync", str(spill)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [f"{journal_path(spill, runs[1])}: delivered 100 points; journal removed"]
    for run_id in runs:
        assert history(sqlite_uri, run_id, "x") == [(s, float(s)) for s in range(100)]
    assert os.listdir(spill) == []
