"""Journaling recovers, and every point is counted: on a real small filesystem (a 256 KiB tmpfs) that
fills during an outage and is freed, and with the spill folder deleted under a running writer.

The store is unreachable the way a stopped server is: the writer sends to a 127.0.0.1 port where
nothing listens. After close(), `rldiag sync` replays the journal into a real SQLite store, and the
store then holds exactly the points the writer said were journaled.

Before: one failed journal write turned journaling off for the rest of the run, also after space was
freed; the RAM cap stopped applying (187,000 points in memory with a cap of 1,000); close() said the
undelivered points "are saved in" a journal that held 14,000 of 200,000.
"""

from __future__ import annotations

import logging
import shutil
import sqlite3
import time

from rldiag.app.cli.main import main
from rldiag.collectors.journal import journal_path
from rldiag.collectors.journal_read import lock_path, segment_files
from rldiag.collectors.mlflow_store import make_sender, open_run
from rldiag.collectors.writer import JournalState, MetricWriter
from tests.helpers.net import free_port
from tests.helpers.writer import RamWatch

KEYS = 10


def stored(sqlite_uri: str, run_id: str) -> set[tuple[str, int]]:
    """The distinct (key, step) points of the run in the SQLite store, read from its file."""
    with sqlite3.connect(sqlite_uri.removeprefix("sqlite:///")) as db:
        return set(db.execute("SELECT DISTINCT key, step FROM metrics WHERE run_uuid = ?", (run_id,)))


def log_steps(w: MetricWriter, steps: range, pause_every: int = 20) -> None:
    """KEYS points a step; a short pause now and then, so that the ingest thread writes batches as it goes."""
    for step in steps:
        w.log_metrics({f"k{i}": float(step) + i / 100 for i in range(KEYS)}, step)
        if step % pause_every == pause_every - 1:
            time.sleep(0.06)
    time.sleep(0.3)  # the last batch journaled (ingest linger 50 ms)


def test_disk_fills_mid_outage_then_frees_journaling_resumes_and_every_point_is_counted(sqlite_uri, small_fs,
                                                                                        caplog):
    run_id = open_run(sqlite_uri, experiment="recovery", run_name="fill")[1].info.run_id
    spill = small_fs.root / "spill"
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there: the store is down all along
    w = MetricWriter(run_id, make_sender(down), tracking_uri=down, spill_dir=spill, backlog_points=1000,
                     segment_bytes=16 << 10, backoff_s=(0.05, 0.2))
    watch = RamWatch(w)
    with caplog.at_level(logging.WARNING, logger="rldiag.writer"):
        log_steps(w, range(0, 100))  # 1000 points journaled
        assert w._jstate is JournalState.UP and w.stats.lost == 0
        small_fs.fill()
        log_steps(w, range(100, 600))  # 5000 points while the disk is full
        assert w._jstate is JournalState.DOWN
        lost_full = w.stats.lost_memory
        assert lost_full > 0 and w.stats.lost == lost_full  # what did not fit under the cap, counted
        assert w._ram_points <= 1000
        small_fs.free()
        log_steps(w, range(600, 900))  # 3000 points once the disk is writable again
        assert w._jstate is JournalState.UP
        assert w.stats.lost == lost_full  # 0 lost once the disk is writable again
        stats = w.close(timeout=1)
    peak = watch.stop()
    print(f"\ndisk fills and frees: {stats.ledger()}; RAM peak {peak}")
    assert peak <= 1000  # the RAM cap held while the journal was down
    text = caplog.text
    assert text.count("cannot write the local journal") == 1 and "No space left" in text  # one per stretch
    assert f"{lost_full} points did not fit in memory while it was down and are lost" in text
    assert stats.logged == 9000 and stats.delivered == 0 and stats.balance() == 0, stats.ledger()
    # the batches held in memory while the journal was down were journaled at close: nothing more lost
    assert stats.journaled + stats.lost == 9000 and stats.lost == lost_full
    path = journal_path(spill, run_id)
    summary = [r.getMessage() for r in caplog.records if "were not delivered" in r.getMessage()]
    assert len(summary) == 1
    assert (f"{stats.undelivered} metric points of run {run_id} were not delivered" in summary[0]
            and f"0 in the store, {stats.journaled} in the journal {path}" in summary[0]
            and f"rldiag sync {path}" in summary[0] and f"{lost_full} lost (" in summary[0]), summary[0]

    assert main(["sync", str(path), "--tracking-uri", sqlite_uri]) == 0
    got = stored(sqlite_uri, run_id)
    assert len(got) == stats.journaled  # what close() said is in the journal is what the store now has
    assert {(f"k{i}", s) for s in range(100) for i in range(KEYS)} <= got  # journaled before the disk filled
    assert {(f"k{i}", s) for s in range(600, 900) for i in range(KEYS)} <= got  # and after it was freed
    assert segment_files(spill, run_id) == []


def test_spill_folder_deleted_under_a_running_writer_is_made_again(sqlite_uri, tmp_path, caplog):
    run_id = open_run(sqlite_uri, experiment="recovery", run_name="rm")[1].info.run_id
    spill = tmp_path / "spill"
    down = f"http://127.0.0.1:{free_port()}"
    w = MetricWriter(run_id, make_sender(down), tracking_uri=down, spill_dir=spill, backlog_points=300,
                     backoff_s=(0.05, 0.2))
    with caplog.at_level(logging.WARNING, logger="rldiag.writer"):
        log_steps(w, range(0, 100))  # 1000 points: 300 in memory, the rest only in the journal
        assert w.stats.spilled > 0
        shutil.rmtree(spill)
        log_steps(w, range(100, 200))
        assert spill.is_dir() and lock_path(spill, run_id).exists()  # made again, and locked again
        assert segment_files(spill, run_id)  # a new segment holds what came after
        stats = w.close(timeout=1)
    print(f"\nspill folder removed: {stats.ledger()}")
    assert "was removed while the run went on: made it again" in caplog.text
    assert stats.logged == 2000 and stats.balance() == 0, stats.ledger()
    # what waited only in the removed files is lost, and counted; the rest is journaled
    assert stats.lost == stats.lost_unreadable > 0 and stats.journaled + stats.lost == 2000
    assert main(["sync", str(journal_path(spill, run_id)), "--tracking-uri", sqlite_uri]) == 0
    got = stored(sqlite_uri, run_id)
    assert len(got) == stats.journaled
    assert {(f"k{i}", s) for s in range(100, 200) for i in range(KEYS)} <= got  # all of it after the removal
