"""Finding runs the way the runs overview does: by experiment, rldiag tags and ids, with clear errors."""

from __future__ import annotations

import pytest

from rldiag.app.data.runs import RUN_COLUMNS, find_runs, runs_with_metrics
from rldiag.app.data.store import open_store
from rldiag.app.errors import (
    ExperimentNotFound,
    NoRunsFound,
    RunNotFound,
    StoreUnreachable,
)
from rldiag.collectors import keys
from tests.helpers.net import free_port
from tests.helpers.runs import log_raw, write_run


def _tags(group: str, variant: str, role: str, seed: int) -> dict[str, str]:
    return {keys.TAG_GROUP: group, keys.TAG_VARIANT: variant, keys.TAG_ROLE: role, keys.TAG_SEED: str(seed)}


def _comparison(uri: str) -> dict[str, str]:
    """Two groups in two experiments: a reference and candidates, one still running."""
    ids = {}
    ids["ref"] = write_run(uri, experiment="v0_vs_v1", name="v0 seed 0", tags=_tags("v0_vs_v1", "v0-parity", "reference", 0),
                           steps=[(s, {keys.GRAD_NORM: 1.0, keys.RATIO_MEAN: 1.0}) for s in range(5)])
    ids["cand"] = write_run(uri, experiment="v0_vs_v1", name="v1 seed 0", tags=_tags("v0_vs_v1", "v1-defaults", "candidate", 0),
                            steps=[(s, {keys.GRAD_NORM: 1.0}) for s in range(8)], finish=False)
    ids["cand2"] = write_run(uri, experiment="v0_vs_v1", name="v1 seed 1", tags=_tags("v0_vs_v1", "v1-defaults", "candidate", 1),
                             steps=[(s, {keys.GRAD_NORM: float("nan")}) for s in range(3)])
    ids["masked"] = write_run(uri, experiment="nan-grads", name="masked", tags=_tags("masking", "masked", "reference", 0),
                              steps=[(s, {keys.LOSS: 0.5}) for s in range(2)])
    return ids


def test_find_runs_by_experiment_tags_and_ids(store_uri):
    ids = _comparison(store_uri)
    runs = find_runs(open_store(store_uri), experiments="v0_vs_v1")
    assert list(runs.columns) == list(RUN_COLUMNS)
    assert set(runs.run_id) == {ids["ref"], ids["cand"], ids["cand2"]}
    assert runs.start_time.is_monotonic_decreasing  # newest first, as MLflow lists them

    ref = runs.set_index("run_id").loc[ids["ref"]]
    assert (ref["name"], ref["experiment"], ref["status"]) == ("v0 seed 0", "v0_vs_v1", "FINISHED")
    assert (ref["group"], ref["variant"], ref["role"], ref["seed"]) == ("v0_vs_v1", "v0-parity", "reference", "0")
    assert ref["last_step"] == 4
    assert ref["metrics"] == (keys.GRAD_NORM, keys.RATIO_MEAN)
    assert runs.set_index("run_id").loc[ids["cand"], "status"] == "RUNNING"
    assert runs.set_index("run_id").loc[ids["cand"], "last_step"] == 7

    cands = find_runs(open_store(store_uri), experiments=["v0_vs_v1"], role="candidate")
    assert set(cands.run_id) == {ids["cand"], ids["cand2"]}
    assert set(find_runs(open_store(store_uri), variant=["v0-parity", "masked"]).run_id) == {ids["ref"], ids["masked"]}
    assert set(find_runs(open_store(store_uri), group="masking").run_id) == {ids["masked"]}  # across experiments
    by_id = find_runs(open_store(store_uri), run_ids=[ids["masked"], ids["ref"]])
    assert set(by_id.run_id) == {ids["masked"], ids["ref"]}
    assert set(find_runs(open_store(store_uri), run_ids=[ids["masked"], ids["ref"]], experiments="nan-grads").run_id) == {ids["masked"]}


def test_foreign_metric_names_count_as_canonical(store_uri):
    rid = write_run(store_uri, experiment="trl", name="grpo")
    log_raw(store_uri, rid, [("grad_norm", 0.5, 1, 3), ("clip_ratio/region_mean", 0.0, 1, 3), ("learning_rate", 1e-5, 1, 3)])
    other = write_run(store_uri, experiment="trl", name="no rl metrics")
    log_raw(store_uri, other, [("learning_rate", 1e-5, 1, 1)])
    runs = find_runs(open_store(store_uri), experiments="trl")
    assert runs.set_index("run_id").loc[rid, "metrics"] == (keys.GRAD_NORM, "learning_rate", keys.CLIP_ACTIVE_RATE)  # sorted
    has_rl = dict(zip(runs.run_id, runs_with_metrics(runs)))
    assert has_rl == {rid: True, other: False}  # the dashboard says which runs have no canonical metric


def test_alert_tags_show_in_the_overview(store_uri):
    rid = write_run(store_uri, name="nan run", tags={keys.TAG_ALERT_COUNT: "3", keys.TAG_ALERT_FIRST_STEP: "7"})
    row = find_runs(open_store(store_uri), run_ids=[rid]).iloc[0]
    assert (row["alerts"], row["first_alert_step"]) == (3, 7)


def test_errors_name_the_value_and_the_fix(store_uri, tmp_path):
    _comparison(store_uri)
    with pytest.raises(ExperimentNotFound) as e:
        find_runs(open_store(store_uri), experiments=["v0_vs_v1", "v2"])
    assert "'v2'" in str(e.value) and "nan-grads" in str(e.value)  # what is there instead
    with pytest.raises(NoRunsFound) as e:
        find_runs(open_store(store_uri), experiments="v0_vs_v1", variant="nope")
    assert "variant='nope'" in str(e.value) and "filter" in str(e.value)
    with pytest.raises(RunNotFound) as e:
        find_runs(open_store(store_uri), run_ids=["0123456789abcdef0123456789abcdef"])
    assert "0123456789abcdef0123456789abcdef" in str(e.value)

    missing = tmp_path / "elsewhere" / "mlruns.db"
    with pytest.raises(StoreUnreachable) as e:
        find_runs(open_store(f"sqlite:///{missing}"))
    assert str(missing) in str(e.value) and "MLFLOW_TRACKING_URI" in str(e.value)
    assert not missing.exists() and not missing.parent.exists()  # reading never creates a store
    not_mlflow = tmp_path / "notes.db"
    not_mlflow.write_bytes(b"")
    with pytest.raises(StoreUnreachable, match="not an MLflow tracking store"):
        open_store(f"sqlite:///{not_mlflow}")
    down = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(StoreUnreachable) as e:
        find_runs(open_store(down))
    assert down in str(e.value) and "mlflow server" in str(e.value)


def test_empty_experiment_is_no_runs(store_uri):
    from mlflow import MlflowClient

    MlflowClient(store_uri).create_experiment("empty")
    with pytest.raises(NoRunsFound, match="experiments='empty'"):
        find_runs(open_store(store_uri), experiments="empty")


@pytest.mark.server
def test_find_runs_over_a_tracking_server(mlflow_server):
    ids = _comparison(mlflow_server.uri)
    runs = find_runs(open_store(mlflow_server.uri), experiments="v0_vs_v1", role="candidate").set_index("run_id")
    assert set(runs.index) == {ids["cand"], ids["cand2"]}
    assert runs.loc[ids["cand"], "last_step"] == 7 and runs.loc[ids["cand"], "status"] == "RUNNING"
    assert runs.loc[ids["cand2"], "metrics"] == (keys.GRAD_NORM,)
    with pytest.raises(ExperimentNotFound, match="'nope'"):
        find_runs(open_store(mlflow_server.uri), experiments="nope")


def test_run_labels_are_unique_and_say_the_name():
    from rldiag.app.data.runs import run_labels

    labels = run_labels({"aaaaaaaa1111": "ref", "bbbbbbbb2222": "cand", "cccccccc3333": "cand", "dddddddd4444": None})
    assert labels == {"aaaaaaaa1111": "ref", "bbbbbbbb2222": "cand (bbbbbbbb)", "cccccccc3333": "cand (cccccccc)",
                      "dddddddd4444": "run (dddddddd)"}
