"""`rldiag import wandb`: offline runs written by wandb itself, imported and read back by rldiag."""

from __future__ import annotations

import math

import numpy as np

from rldiag.app.cli.main import main
from rldiag.app.importers import compat_wandb
from rldiag.app.data.histories import load_histories
from rldiag.app.data.store import open_store
from rldiag.app.importers.loop import import_path
from rldiag.collectors import keys
from tests.helpers.importers import imported_runs, metric_rows, write_wandb


def trl_steps(n: int):
    """TRL's names as transformers' WandbCallback logs them; grad norm NaN at 3, IS ratio min +inf at 5."""
    for s in range(1, n + 1):
        yield s, {"train/grad_norm": math.nan if s == 3 else 0.5 + s / 10, "train/loss": 1.0 / s,
                  "train/sampling/importance_sampling_ratio/min": math.inf if s == 5 else 0.9}


def test_trl_run_is_read_back_at_its_steps_with_nan_inf_and_config(store_uri, tmp_path, capsys):
    f = write_wandb(tmp_path, trl_steps(12), project="grpo-gsm8k",
                    config={"learning_rate": 1e-6, "beta": 0.0, "model": {"name": "tiny", "layers": 2}})
    rc = main(["import", "wandb", str(f.parent), "--group", "gsm8k", "--role", "reference",
               "--tracking-uri", store_uri])
    assert rc == 0, capsys.readouterr()
    (run,) = imported_runs(store_uri)
    assert run.info.status == "FINISHED" and run.data.tags[keys.TAG_ROLE] == "reference"
    assert run.data.tags["rldiag.import.source"] == str(f.parent.resolve())
    assert {k: run.data.params[k] for k in ("learning_rate", "beta", "model.name", "model.layers")} == \
        {"learning_rate": "1e-06", "beta": "0.0", "model.name": "tiny", "model.layers": "2"}
    from mlflow import MlflowClient

    assert MlflowClient(store_uri).get_experiment(run.info.experiment_id).name == "grpo-gsm8k"  # the W&B project
    rid = run.info.run_id
    h = load_histories(open_store(store_uri), [rid], [keys.GRAD_NORM, keys.LOSS, "train/sampling/"
                                                      "importance_sampling_ratio/min"])
    gn = h.get(rid, keys.GRAD_NORM)
    assert gn.source_key == "train/grad_norm"
    np.testing.assert_array_equal(gn.steps, np.arange(1, 13))
    assert math.isnan(gn.values[2]) and gn.values[3] == 0.9  # float64 through W&B's JSON
    np.testing.assert_allclose(h.get(rid, keys.LOSS).values, 1.0 / np.arange(1, 13))
    nf = h.get(rid, "train/sampling/importance_sampling_ratio/min").nonfinite()
    assert list(nf.posinf) == [5] and nf.count == 1


def test_reimport_adds_nothing(store_uri, tmp_path, capsys):
    f = write_wandb(tmp_path, trl_steps(8))
    assert main(["import", "wandb", str(tmp_path / "wandb"), "--tracking-uri", store_uri]) == 0
    rows = metric_rows(store_uri)
    assert rows == 8 * 3 + 1  # and the inf flag of step 5
    capsys.readouterr()
    assert main(["import", "wandb", str(f), "--tracking-uri", store_uri]) == 0  # the file itself: the same run
    assert "0 points of 0 keys imported; 24 points already imported were skipped" in capsys.readouterr().out
    assert metric_rows(store_uri) == rows and len(imported_runs(store_uri)) == 1


def test_a_corrupt_record_is_one_line_and_the_records_before_it_are_imported(store_uri, tmp_path, capsys):
    f = write_wandb(tmp_path, ((s, {"loss": float(s)}) for s in range(300)))
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    assert main(["import", "wandb", str(f.parent), "--tracking-uri", store_uri]) == 1
    (problem,) = [ln for ln in capsys.readouterr().out.splitlines() if ": corrupt at byte" in ln]
    assert problem.startswith(f"{f}: corrupt at byte ")
    (run,) = imported_runs(store_uri)
    steps = load_histories(open_store(store_uri), [run.info.run_id], ["loss"]).get(run.info.run_id, "loss").steps
    assert len(steps) >= 299 and steps[0] == 0 and steps[-1] == 299  # the damaged row at most is lost


def test_after_a_corrupt_record_the_records_after_it_are_imported(store_uri, tmp_path, capsys):
    # reading goes on at the next chunk that passes its CRC (found byte by byte): only the damaged row is lost
    f = write_wandb(tmp_path, ((s, {"loss": float(s)}) for s in range(800)))
    data = bytearray(f.read_bytes())
    for end, record in compat_wandb.read_records(bytes(data[len(compat_wandb.FILE_HEADER):])):
        kind, rec = compat_wandb.parse_record(record)
        if kind == "history" and {compat_wandb.item_key(i): i.value_json for i in rec.history.item}["_step"] == "400":
            data[end - 1] ^= 0xFF  # the record's last data byte
            break
    f.write_bytes(bytes(data))
    assert main(["import", "wandb", str(f.parent), "--tracking-uri", store_uri]) == 1
    (problem,) = [ln for ln in capsys.readouterr().out.splitlines() if ": corrupt at byte" in ln]
    assert problem.startswith(f"{f}: corrupt at byte ") and "the records before and after them imported" in problem
    (run,) = imported_runs(store_uri)
    steps = load_histories(open_store(store_uri), [run.info.run_id], ["loss"]).get(run.info.run_id, "loss").steps
    assert sorted(set(range(800)) - set(steps.tolist())) == [400]


def test_a_corrupt_first_record_loses_only_itself(store_uri, tmp_path, capsys):
    # a small run (one 32 KiB block): damaged near the start, every history row after it is still imported
    f = write_wandb(tmp_path, ((s, {"loss": float(s)}) for s in range(50)))
    data = bytearray(f.read_bytes())
    data[100] ^= 0xFF
    f.write_bytes(bytes(data))
    assert main(["import", "wandb", str(f.parent), "--tracking-uri", store_uri]) == 1
    assert f"{f}: corrupt at byte " in capsys.readouterr().out
    (run,) = imported_runs(store_uri)
    steps = load_histories(open_store(store_uri), [run.info.run_id], ["loss"]).get(run.info.run_id, "loss").steps
    assert steps.tolist() == list(range(50))


def test_metrics_defined_against_a_step_metric_are_imported_at_its_value(store_uri, tmp_path):
    # transformers' WandbCallback (TRL): define_metric("*", step_metric="train/global_step"); with logging_steps=10
    # the rows are W&B's _step 0, 1, 2, ... but the trainer's steps 10, 20, 30, ...: the import keeps the latter
    write_wandb(tmp_path, ((s, {"train/grad_norm": 1.0 if s != 30 else math.nan}) for s in range(10, 110, 10)),
                step_metric="train/global_step")
    assert main(["import", "wandb", str(tmp_path / "wandb"), "--tracking-uri", store_uri]) == 0
    (run,) = imported_runs(store_uri)
    gn = load_histories(open_store(store_uri), [run.info.run_id], [keys.GRAD_NORM]).get(run.info.run_id, keys.GRAD_NORM)
    assert gn.steps.tolist() == list(range(10, 110, 10)) and list(gn.nonfinite().nan) == [30]


def test_not_a_wandb_run_is_one_line_naming_the_file(store_uri, tmp_path, capsys):
    run_dir = tmp_path / "wandb" / "run-20261207_000000-abc"
    run_dir.mkdir(parents=True)
    (run_dir / "run-abc.wandb").write_bytes(b"not a wandb file at all")
    assert main(["import", "wandb", str(tmp_path / "wandb"), "--tracking-uri", store_uri]) == 1
    out = capsys.readouterr().out.strip()
    f = run_dir / "run-abc.wandb"
    assert out == f"{f}: not a W&B run file (it does not start with W&B's header ':W&B'); skipped"
    (tmp_path / "nothing").mkdir()
    assert main(["import", "wandb", str(tmp_path / "nothing"), "--tracking-uri", store_uri]) == 2
    assert "no W&B run file" in capsys.readouterr().err


def test_follow_ends_a_wandb_run_at_its_exit_record_failed_on_a_nonzero_exit(store_uri, tmp_path):
    write_wandb(tmp_path, trl_steps(4), exit_code=3)
    said: list[str] = []
    status = import_path("wandb", str(tmp_path / "wandb"), store_uri, tags_for=lambda name: {}, follow=True,
                         interval_s=0.01, max_polls=5, say=said.append)
    assert status == 0
    (run,) = imported_runs(store_uri)
    assert run.info.status == "FAILED"
    assert said[-1].endswith("ended FAILED") and sum("ended" in s for s in said) == 1  # ended once, not per poll


NESTED_SCRIPT = """
import sys, wandb
run = wandb.init(project="p", dir=sys.argv[1])
for s in range(3):
    run.log({"rollout_corr": {"kl": 0.1 * s, "ess": {"norm": 0.9}}, "done": s == 2, "note": "text", "lst": [1, 2]},
            step=s)
run.finish()
"""


def test_nested_dicts_are_named_as_wandb_shows_them_and_non_numbers_are_left_out(store_uri, tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    subprocess.run([sys.executable, "-c", NESTED_SCRIPT, str(tmp_path)], env=env, check=True, timeout=300)
    assert import_path("wandb", str(tmp_path / "wandb"), store_uri, tags_for=lambda name: {}, say=print) == 0
    (run,) = imported_runs(store_uri)
    h = load_histories(open_store(store_uri), [run.info.run_id])
    assert sorted(h.keys) == ["done", "rollout_corr.ess.norm", "rollout_corr.kl"]
    np.testing.assert_allclose(h.get(run.info.run_id, "rollout_corr.kl").values, [0.0, 0.1, 0.2])
    np.testing.assert_array_equal(h.get(run.info.run_id, "done").values, [0.0, 0.0, 1.0])
