"""Only journals are ever deleted: replay and `rldiag sync` remove a file only once it is verified as an
rldiag journal segment (a header for its name, under the journal's lock) and every batch in it is
acknowledged by the store. Anything else in the spill folder, or named to `rldiag sync`, stays
byte-identical (before: `rldiag sync DIR` deleted rldiag's own alerts.jsonl and exited 2, `rldiag sync
my_eval_results.jsonl` deleted the user's file, and a segment of unparsable lines was unlinked as
"fully acknowledged")."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from mlflow import MlflowClient

from rldiag.app.cli.main import main
from rldiag.collectors.journal import Journal, journal_path
from rldiag.collectors.journal_read import lock_path, segment_files, split_name
from rldiag.collectors.mlflow_store import make_sender, open_run
from rldiag.collectors.writer import MetricWriter
from tests.helpers.net import free_port


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def foreign_files(spill: Path, run_id: str) -> dict[Path, str]:
    """Files a spill folder may hold that are not journals; each named in the comment beside it."""
    files = {
        spill / "alerts.jsonl": '{"event": "nan_grad", "step": 3}\n{"event": "nan_grad", "step": 9}\n',  # rldiag's own
        spill / "my_eval_results.jsonl": '{"task": "gsm8k", "acc": 0.41}\n',  # a user's file
        spill / "empty.jsonl": "",
        spill / f"{run_id}.9.jsonl": "not json\n{broken\n",  # a run's segment name, every line unparsable
        spill / f"{run_id}.8.jsonl": json.dumps({"rldiag_journal": 2, "run_id": "someoneelse", "segment": 3}) + "\n"
        + json.dumps({"seq": 0, "n": 1, "m": [["x", 1.0, 1, 0]]}) + "\n",  # a header for another file
        spill / "other.jsonl": json.dumps({"ack": [0, 1]}) + "\n",  # only acks: "fully acknowledged", no header
    }
    for p, text in files.items():
        p.write_text(text)
    return {p: sha(p) for p in files}


def test_foreign_files_in_the_spill_folder_and_named_to_sync_stay_byte_identical(sqlite_uri, tmp_path, capsys):
    run_id = open_run(sqlite_uri, experiment="foreign", run_name="f")[1].info.run_id
    spill = tmp_path / "spill"
    spill.mkdir()
    before = foreign_files(spill, run_id)
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens: the store is unreachable
    w = MetricWriter(run_id, make_sender(down), tracking_uri=down, spill_dir=spill, backoff_s=(0.01, 0.05))
    for step in range(40):
        w.log_metrics({"loss": float(step)}, step)
    stats = w.close(timeout=1)
    assert stats.delivered == 0 and stats.undelivered == 40
    # the writer's segments skip the numbers foreign files hold, never appending to one
    assert [n for n, _ in segment_files(spill, run_id)] == [8, 9, 10]

    # a restart of the run takes over its journal and leaves the foreign files alone
    j = Journal.for_run(spill, run_id, down)
    assert {p.name for p, _ in j.foreign} == {f"{run_id}.9.jsonl", f"{run_id}.8.jsonl"}
    j.close()
    assert {p: sha(p) for p in before} == before

    capsys.readouterr()
    assert main(["sync", str(spill), "--tracking-uri", sqlite_uri]) == 0  # skipping a foreign file is no failure
    out = capsys.readouterr().out
    assert f"{journal_path(spill, run_id)}: delivered 40 points; journal removed" in out
    for name in ("alerts.jsonl", "my_eval_results.jsonl", "empty.jsonl", "other.jsonl"):
        assert f"{spill / name}: skipped: not an rldiag journal" in out, name
    assert out.count("left as it is") == 4  # one line each; the run's foreign segments went with its journal
    hist = MlflowClient(sqlite_uri).get_metric_history(run_id, "loss")
    assert sorted(m.step for m in hist) == list(range(40))
    assert {p: sha(p) for p in before} == before  # every foreign file still there, byte-identical
    assert sorted(os.listdir(spill)) == sorted(p.name for p in before)  # and no lock file left beside them

    for p in before:  # named on its own: exit 2, one line, nothing changed, no lock file made
        assert main(["sync", str(p), "--tracking-uri", sqlite_uri]) == 2
        line = capsys.readouterr().out.strip()
        assert line.startswith(f"{p}: skipped: not an rldiag journal (") and line.endswith("left as it is"), line
        assert "\n" not in line
        assert not lock_path(*split_name(p)[:2]).exists()
    assert {p: sha(p) for p in before} == before
    assert sorted(os.listdir(spill)) == sorted(p.name for p in before)


def test_a_journal_whose_only_batch_is_damaged_is_kept_and_said_so(sqlite_uri, tmp_path, capsys):
    """A verified journal whose one undelivered batch cannot be read back: counted lost, and the file is
    kept as it is (never 'fully acknowledged'); the line says syncing again cannot deliver it."""
    run_id = open_run(sqlite_uri, experiment="foreign", run_name="damaged")[1].info.run_id
    path = tmp_path / f"{run_id}.jsonl"
    path.write_text(json.dumps({"rldiag_journal": 2, "run_id": run_id, "tracking_uri": sqlite_uri, "segment": 0})
                    + '\n{"seq":0,"n":2,"m":[["x",1.0,1,0],[oops]]}\n')
    before = sha(path)
    assert main(["sync", str(path), "--tracking-uri", sqlite_uri]) == 1
    out = capsys.readouterr().out
    assert "the journal is kept, holding only lines that cannot be read back" in out
    assert "2 points in lines that could not be read back" in out
    assert sha(path) == before and [n for n in os.listdir(tmp_path) if n.startswith(run_id)] == [path.name]
