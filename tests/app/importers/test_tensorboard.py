"""`rldiag import tensorboard`: runs written by torch's SummaryWriter, imported and read back by rldiag."""

from __future__ import annotations

import json
import math

import numpy as np

from rldiag.app.cli.main import main
from rldiag.app.data.histories import load_histories
from rldiag.app.data.store import open_store
from rldiag.collectors import keys
from tests.helpers.importers import imported_runs, metric_rows, write_tensorboard

# verl's names (its actor and rollout metrics), each aliased to a canonical key by rldiag's reader
VERL = {"actor/grad_norm": keys.GRAD_NORM, "actor/pg_clipfrac": keys.CLIP_ACTIVE_RATE,
        "actor/entropy": keys.ENTROPY, "training/rollout_probs_diff_max": keys.MISMATCH_PROB_MAX}


def verl_steps(first: int, last: int):
    """Steps first..last; grad norm NaN at 20, clip fraction +inf at 30 and -inf at 31."""
    for s in range(first, last + 1):
        row = {"actor/grad_norm": 1.0 + s / 100, "actor/pg_clipfrac": s / 1000, "actor/entropy": 2.0 - s / 100,
               "training/rollout_probs_diff_max": 0.01 * s}
        if s == 20:
            row["actor/grad_norm"] = math.nan
        if s in (30, 31):
            row["actor/pg_clipfrac"] = math.inf if s == 30 else -math.inf
        yield s, row


def test_verl_run_is_read_back_at_its_steps_with_nan_and_inf(store_uri, tmp_path, capsys):
    logdir = tmp_path / "tensorboard_log"
    write_tensorboard(logdir / "gsm8k" / "ppo_fix", verl_steps(1, 40), hparams={"lr": 1e-6, "algo": "grpo"})
    rc = main(["import", "tensorboard", str(logdir), "--group", "gsm8k", "--role", "candidate", "--variant", "fix",
               "--tracking-uri", store_uri])
    out = capsys.readouterr().out
    assert rc == 0, out
    (run,) = imported_runs(store_uri)
    assert run.info.run_name == "gsm8k/ppo_fix" and run.info.status == "FINISHED"
    tags = run.data.tags
    assert (tags[keys.TAG_GROUP], tags[keys.TAG_ROLE], tags[keys.TAG_VARIANT]) == ("gsm8k", "candidate", "fix")
    assert tags["rldiag.import.source"] == str((logdir / "gsm8k" / "ppo_fix").resolve())
    assert run.data.params["lr"] == "1e-06" and run.data.params["algo"] == "grpo"  # torch's add_hparams
    h = load_histories(open_store(store_uri), [run.info.run_id], list(VERL.values()))
    for name, key in VERL.items():
        t = h.get(run.info.run_id, key)
        assert t.source_key == name
        np.testing.assert_array_equal(t.steps, np.arange(1, 41))
    gn = h.get(run.info.run_id, keys.GRAD_NORM)
    assert math.isnan(gn.values[19]) and gn.values[18] == np.float32(1.19)  # TensorBoard keeps float32
    nf = h.get(run.info.run_id, keys.CLIP_ACTIVE_RATE).nonfinite()
    assert list(nf.posinf) == [30] and list(nf.neginf) == [31]


def test_reimport_adds_nothing_and_a_grown_run_adds_only_its_new_steps(store_uri, tmp_path, capsys):
    logdir = tmp_path / "tb"
    write_tensorboard(logdir, verl_steps(1, 10))
    assert main(["import", "tensorboard", str(logdir), "--tracking-uri", store_uri]) == 0
    rows = metric_rows(store_uri)
    assert rows == 40  # 10 steps x 4 tags, all finite
    capsys.readouterr()
    assert main(["import", "tensorboard", str(logdir), "--tracking-uri", store_uri]) == 0
    assert "0 points of 0 keys imported; 40 points already imported were skipped" in capsys.readouterr().out
    assert metric_rows(store_uri) == rows and len(imported_runs(store_uri)) == 1
    # the run trains on (a second event file, as a restarted SummaryWriter writes): steps 11-35 only are new
    write_tensorboard(logdir, verl_steps(11, 35))
    assert main(["import", "tensorboard", str(logdir), "--tracking-uri", store_uri]) == 0
    (run,) = imported_runs(store_uri)
    h = load_histories(open_store(store_uri), [run.info.run_id], [keys.ENTROPY])
    np.testing.assert_array_equal(h.get(run.info.run_id, keys.ENTROPY).steps, np.arange(1, 36))
    assert metric_rows(store_uri) == 35 * 4 + 2  # and one inf flag each for steps 30 and 31


def test_a_corrupt_record_is_one_line_naming_the_file_and_what_was_readable_is_imported(store_uri, tmp_path, capsys):
    logdir = tmp_path / "tb"
    f = write_tensorboard(logdir, ((s, {"loss": float(s)}) for s in range(100)))
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit pattern in the middle of the file
    f.write_bytes(bytes(data))
    rc = main(["import", "tensorboard", str(logdir), "--tracking-uri", store_uri])
    lines = capsys.readouterr().out.splitlines()
    assert rc == 1
    (problem,) = [ln for ln in lines if ": corrupt at byte" in ln]
    assert problem.startswith(f"{f}: corrupt at byte ") and "the records before and after them imported" in problem
    (run,) = imported_runs(store_uri)
    steps = load_histories(open_store(store_uri), [run.info.run_id], ["loss"]).get(run.info.run_id, "loss").steps
    # reading goes on at the next record whose two CRCs pass: only the damaged step is lost
    assert len(steps) == 99 and steps[0] == 0 and steps[-1] == 99


def test_a_truncated_file_imports_its_whole_records_and_says_so(store_uri, tmp_path, capsys):
    logdir = tmp_path / "tb"
    f = write_tensorboard(logdir, ((s, {"loss": float(s)}) for s in range(50)))
    f.write_bytes(f.read_bytes()[:-10])  # the last record cut short, as a crashed writer leaves it
    assert main(["import", "tensorboard", str(logdir), "--tracking-uri", store_uri]) == 1
    (problem,) = [ln for ln in capsys.readouterr().out.splitlines() if "partial record" in ln]
    assert problem.startswith(f"{f}: ends in a partial record")
    assert metric_rows(store_uri) == 49


def test_no_event_files_is_one_line_and_no_run(store_uri, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["import", "tensorboard", str(tmp_path / "empty"), "--tracking-uri", store_uri]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no TensorBoard event files" in err and str(tmp_path / "empty") in err


def test_follow_imports_new_points_while_running_and_rldiag_watch_alerts_on_the_nan(store_uri, tmp_path):
    """A verl run still training: the first poll imports steps 0-4; the run then logs a NaN grad norm at
    step 6; the next poll imports it while the MLflow run is RUNNING, and `rldiag watch --once` alerts."""
    from torch.utils.tensorboard import SummaryWriter

    from rldiag.app.importers.loop import import_path

    logdir = tmp_path / "tb"
    w = SummaryWriter(str(logdir))
    for s in range(5):
        w.add_scalar("actor/grad_norm", 1.0, s)
    w.flush()
    said: list[str] = []
    seen: dict[str, object] = {}

    def say(line: str) -> None:  # runs between polls, in the importer's thread: no timing involved
        said.append(line)
        if len(said) == 1:
            for s in range(5, 8):
                w.add_scalar("actor/grad_norm", math.nan if s == 6 else 1.0, s)
            w.flush()
        elif len(said) == 2:
            seen["status"] = imported_runs(store_uri)[0].info.status
            seen["watch"] = main(["watch", "--once", "--tracking-uri", store_uri, "--state", str(tmp_path / "state"),
                                  "--jsonl", str(tmp_path / "alerts.jsonl")])

    status = import_path("tensorboard", str(logdir), store_uri, tags_for=lambda name: {}, follow=True,
                         interval_s=0.01, max_polls=3, say=say)
    w.close()
    assert status == 0
    (run,) = imported_runs(store_uri)
    assert said[0] == f"tb: +5 points (run {run.info.run_id})" and said[1] == f"tb: +3 points (run {run.info.run_id})"
    assert seen == {"status": "RUNNING", "watch": 1}  # 1: alerts sent
    (alert,) = [json.loads(ln) for ln in (tmp_path / "alerts.jsonl").read_text().splitlines()]
    assert (alert["run_id"], alert["step"], alert["keys"]) == (run.info.run_id, 6, {"actor/grad_norm": "nan"})
    assert run.info.status == "FINISHED" and said[-1].endswith("8 points of 1 keys imported; ended FINISHED")
    gn = load_histories(open_store(store_uri), [run.info.run_id], [keys.GRAD_NORM]).get(run.info.run_id, keys.GRAD_NORM)
    np.testing.assert_array_equal(gn.steps, np.arange(8))
    assert list(gn.nonfinite().nan) == [6]


def test_a_tag_mlflow_refuses_is_logged_under_a_close_name_and_reimported_idempotently(store_uri, tmp_path):
    logdir = tmp_path / "tb"
    write_tensorboard(logdir, [(s, {"eval/acc@1": s / 10}) for s in range(5)])
    assert main(["import", "tensorboard", str(logdir), "--tracking-uri", store_uri]) == 0
    assert main(["import", "tensorboard", str(logdir), "--tracking-uri", store_uri]) == 0
    (run,) = imported_runs(store_uri)
    assert set(run.data.metrics) == {"eval/acc_1"} and metric_rows(store_uri) == 5


def test_follow_picks_up_a_run_folder_that_appears_under_the_logdir(store_uri, tmp_path):
    from rldiag.app.importers.loop import import_path

    logdir = tmp_path / "tb"
    write_tensorboard(logdir / "a", [(0, {"loss": 1.0})])
    said: list[str] = []

    def say(line: str) -> None:
        said.append(line)
        if line.startswith("a: +"):  # between the first and the second poll, a second job starts logging
            write_tensorboard(logdir / "b", [(0, {"loss": 2.0}), (1, {"loss": 3.0})])

    assert import_path("tensorboard", str(logdir), store_uri, tags_for=lambda name: {"rldiag.group": "g"},
                       follow=True, interval_s=0.01, max_polls=2, say=say) == 0
    runs = {r.info.run_name: r for r in imported_runs(store_uri)}
    assert sorted(runs) == ["a", "b"] and runs["b"].data.tags["rldiag.group"] == "g"
    assert [s for s in said if s.startswith("b: +")] == [f"b: +2 points (run {runs['b'].info.run_id})"]


def test_a_run_is_read_and_sent_a_bounded_number_of_points_at_a_time(store_uri, tmp_path, monkeypatch, capsys):
    """With 7 points a part, 2 event files of 60 points each are imported whole, in order, with no false
    'partial record' and nothing twice."""
    from rldiag.app.importers import common

    monkeypatch.setattr(common, "POLL_POINTS", 7)
    logdir = tmp_path / "tb"
    write_tensorboard(logdir, [(s, {"loss": float(s), "kl": -s}) for s in range(30)])
    write_tensorboard(logdir, [(s, {"loss": float(s), "kl": -s}) for s in range(30, 60)])
    assert main(["import", "tensorboard", str(logdir), "--tracking-uri", store_uri]) == 0
    assert "120 points of 2 keys imported; ended FINISHED" in capsys.readouterr().out
    (run,) = imported_runs(store_uri)
    h = load_histories(open_store(store_uri), [run.info.run_id], ["loss", "kl"])
    np.testing.assert_array_equal(h.get(run.info.run_id, "kl").values, -np.arange(60))
    assert metric_rows(store_uri) == 120
