"""Config diff: the settings that break train-inference parity first, then batch sizes, then the rest."""

from __future__ import annotations

import pytest

from rldiag.app.analysis.config_diff import (
    GROUP_BATCH,
    GROUP_OTHER,
    GROUP_PARITY,
    GROUP_TAGS,
    RunConfig,
    config_diff,
    load_configs,
)
from rldiag.app.data.store import open_store
from rldiag.app.errors import RunNotFound
from rldiag.collectors import keys
from tests.helpers.runs import write_run

V0 = {
    "engine": {"name": "vllm", "version": "0.10.2", "logprobs_mode": "processed_logprobs",
               "enable_prefix_caching": False, "async_scheduling": False, "dtype": "bfloat16"},
    "model": {"name": "tiny", "lm_head_dtype": "float32"},
    "trainer": {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "learning_rate": 1e-6,
                "seed": 0},
}
V1 = {
    "engine": {"name": "vllm", "version": "0.11.0", "logprobs_mode": "raw_logprobs",
               "enable_prefix_caching": True, "async_scheduling": True, "dtype": "bfloat16"},
    "model": {"name": "tiny", "lm_head_dtype": "bfloat16"},
    "trainer": {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 4, "learning_rate": 1e-6,
                "seed": 1},
    "vllm_enable_prefix_caching": True,  # a foreign spelling of a parity knob
}


def test_parity_knobs_first_then_batch_then_the_rest(store_uri):
    v0 = write_run(store_uri, name="v0", params=V0, tags={keys.TAG_VARIANT: "v0-parity", keys.TAG_GROUP: "g"})
    v1 = write_run(store_uri, name="v1", params=V1, tags={keys.TAG_VARIANT: "v1-defaults", keys.TAG_GROUP: "g"})
    configs = load_configs(open_store(store_uri), [v0, v1])
    diff = config_diff(configs, labels={v0: "v0", v1: "v1"})
    assert diff.columns.tolist() == ["group", "kind", "name", "v0", "v1"]
    assert diff.name.tolist() == [
        "engine.logprobs_mode", "engine.enable_prefix_caching", "engine.async_scheduling", "model.lm_head_dtype",
        "vllm_enable_prefix_caching",  # parity, in the canonical order, foreign spellings after
        "trainer.gradient_accumulation_steps",  # batch / accumulation
        "engine.version", "trainer.seed",  # other params
        keys.TAG_VARIANT,  # tags (equal ones and MLflow's own left out)
    ]
    assert diff.group.tolist() == [GROUP_PARITY] * 5 + [GROUP_BATCH] + [GROUP_OTHER] * 2 + [GROUP_TAGS]
    row = diff.set_index("name").loc["engine.logprobs_mode"]
    assert (row.v0, row.v1) == ("processed_logprobs", "raw_logprobs")
    missing = diff.set_index("name").loc["vllm_enable_prefix_caching"]
    assert missing.v0 is None and missing.v1 == "True"  # a param one run lacks differs

    full = config_diff(configs, labels={v0: "v0", v1: "v1"}, only_differing=False)
    names = full.name.tolist()
    assert {"engine.dtype", "trainer.per_device_train_batch_size", "engine.name", keys.TAG_GROUP} <= set(names)
    assert names.index("engine.dtype") < names.index("model.lm_head_dtype")  # canonical knob order
    assert names.index("trainer.per_device_train_batch_size") < names.index("engine.name")
    assert not any(n.startswith("mlflow.") for n in names)
    assert "mlflow.runName" in config_diff(configs, include_mlflow_tags=True).name.tolist()


def test_labels_must_be_unique_and_ids_must_exist(store_uri):
    a = RunConfig({"x": "1"}, {})
    with pytest.raises(ValueError, match="unique"):
        config_diff({"r1": a, "r2": a}, labels={"r1": "same", "r2": "same"})
    with pytest.raises(RunNotFound, match="0123456789abcdef0123456789abcdef"):
        load_configs(open_store(store_uri), ["0123456789abcdef0123456789abcdef"])
    three = config_diff({"r1": a, "r2": RunConfig({"x": "1"}, {}), "r3": RunConfig({"x": "2"}, {})})
    assert three.r3.tolist() == ["2"] and three.r1.tolist() == ["1"]
