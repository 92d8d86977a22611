"""Likely causes on stock TRL GRPO runs: a real tiny `GRPOTrainer` logging through transformers' own MLflow
integration (`report_to="mlflow"`, no rldiag collector, no engine fingerprint), one run clean, one whose
loss turns NaN at its last step. Trainer's `logging_nan_inf_filter` (on by default) logs a finite loss
there while `grad_norm` is NaN: the NaN-filter cause, from what the stock run logged."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("trl")

from rldiag.app.analysis.causes import SIGNATURE_KEYS, likely_causes
from rldiag.app.analysis.config_diff import load_configs
from rldiag.app.data.histories import load_histories
from rldiag.app.data.store import open_store
from rldiag.app.watch.loop import watch_once

STEPS = 3
NAN_AT = 3  # the logged step (global_step after the update) whose loss is multiplied by NaN


def stock_grpo_run(uri: str, tmp_path, name: str, *, nan: bool) -> str:
    """A stock GRPO run of STEPS steps logged by transformers' MLflowCallback; returns its run id."""
    import mlflow
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from tests.helpers.tiny_hf import save_tiny_qwen2

    class NanLossTrainer(GRPOTrainer):
        # global_step counts finished updates: 2 while the third step (logged as step 3) computes its loss
        def compute_loss(self, *args, **kw):
            loss = super().compute_loss(*args, **kw)
            return loss * float("nan") if nan and self.state.global_step == NAN_AT - 1 else loss

    model_dir = tmp_path / f"model-{name}"
    tok = save_tiny_qwen2(model_dir, vocab=64)
    args = GRPOConfig(output_dir=str(tmp_path / f"out-{name}"), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=4, max_steps=STEPS, logging_steps=1, report_to="mlflow", run_name=name,
                      use_vllm=False, beta=0.0, save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True)
    prompts = Dataset.from_dict({"prompt": [f"w{i} w{i + 1} w{i + 2}" for i in range(8)]})
    def reward_len(completions, **kw):  # named: TRL logs "profiling/Time taken: <class>.<function name>"
        return [float(len(c)) for c in completions]

    trainer = NanLossTrainer(model=str(model_dir), reward_funcs=reward_len, args=args, train_dataset=prompts,
                             processing_class=tok)
    trainer.train()
    logged = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    if nan:  # what the filter did: a finite loss where the gradients are NaN
        assert math.isfinite(logged[NAN_AT]["loss"]) and math.isnan(logged[NAN_AT]["grad_norm"])
    run_id = mlflow.last_active_run().info.run_id
    mlflow.end_run()
    return run_id


@pytest.mark.filterwarnings("ignore:TRL currently supports vLLM versions")
def test_stock_trl_nan_behind_its_nan_filter_is_named_with_the_filter_setting(store_uri, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store_uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "stock-grpo")
    ref = stock_grpo_run(store_uri, tmp_path, "clean", nan=False)
    cand = stock_grpo_run(store_uri, tmp_path, "nan", nan=True)
    store = open_store(store_uri)
    h = load_histories(store, [ref, cand], list(SIGNATURE_KEYS))
    configs = load_configs(store, [ref, cand])
    assert configs[cand].params["logging_nan_inf_filter"] == "True"  # transformers logs its arguments
    assert not any(k.startswith("engine.") for k in configs[cand].params)  # no engine fingerprint

    (rc,) = likely_causes(h, configs, [ref], [cand])
    assert [c.id for c in rc.causes] == ["nan_filter"]
    cause = rc.first
    # the filter replaced the NaN step's loss by the running average since the last log, which here is 0.0
    assert cause.signature[0] == f"loss logged as exactly 0.0 at step {NAN_AT} where the gradients are non-finite"
    assert cause.settings == ("logging_nan_inf_filter=True",)
    assert "set logging_nan_inf_filter=False" in cause.fix
    # the clean run vs itself: nothing to name
    (clean,) = likely_causes(h, configs, [cand], [ref])
    assert clean.causes == ()

    # the watcher's NaN alert carries the cause
    _, events = watch_once(store)
    (event,) = [e for e in events if e["run_id"] == cand]
    assert event["step"] == NAN_AT and event["cause"].startswith("likely: a trainer's NaN filter hides a NaN loss")
    assert event["text"].endswith(event["cause"])
