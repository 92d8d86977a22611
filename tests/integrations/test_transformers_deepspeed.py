"""The transformers callback under DeepSpeed ZeRO 1, 2 and 3 through accelerate (`TrainingArguments(deepspeed=...)`),
2 real gloo processes on the CPU (DeepSpeed's CPU accelerator), a NaN gradient on rank 1 at one step.

accelerate runs `engine.step()` inside `accelerator.backward`, so when the callback's hook runs the engine
has stepped and its gradient partitions are gone; the callback's per-parameter hooks saw each rank's
gradient before DeepSpeed reduced it. The finite flag comes from those (a NaN on any rank is one in the
reduced gradient), the norm is DeepSpeed's own of the reduced gradients (before, the callback logged the
largest rank's local norm: 1.94 where DeepSpeed and the Trainer logged 1.39).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from mlflow import MlflowClient

from rldiag.collectors import keys
from tests.helpers.net import free_port

NAN_STEP = 2  # optimizer step (global_step after it) whose backward is NaN on rank 1


def _worker(rank: int, world: int, port: int, uri: str, out: str, stage: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), MLFLOW_DISABLE_TELEMETRY="true")
    import torch
    from transformers import LlamaForCausalLM, Trainer

    from rldiag.collectors.integrations.transformers import RldiagCallback
    from tests.helpers.tiny_hf import llama_config, lm_dataset, training_args

    class NanOnRank1(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, **kw):
            loss = super().compute_loss(model, inputs, return_outputs=return_outputs, **kw)
            if rank == 1 and self.state.global_step == NAN_STEP - 1:  # finite forward, NaN backward
                w = self.model.lm_head.weight
                loss = loss + 0.0 * ((w - w.detach()) ** 2).sum().sqrt()
            return loss

    torch.manual_seed(0)
    ds_config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                 "gradient_clipping": "auto", "zero_optimization": {"stage": stage},
                 "zero_allow_untested_optimizer": True}
    args = training_args(Path(out) / f"rank{rank}", per_device_train_batch_size=2, max_steps=4, deepspeed=ds_config)
    trainer = NanOnRank1(model=LlamaForCausalLM(llama_config()), args=args, train_dataset=lm_dataset(16))
    RldiagCallback(experiment="deepspeed", run_name=f"zero{stage}", tracking_uri=uri, policy="warn",
                   spill_dir=os.path.join(out, f"spill{rank}")).attach(trainer)
    trainer.train()
    logged = {h["step"]: h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h}
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "engine": type(trainer.model_wrapped).__name__, "trainer_grad_norm": logged}))
    from tests.helpers.gloo_job import teardown

    teardown()


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_under_deepspeed_the_callback_logs_deepspeeds_norm_and_flags_the_nan_step(stage, sqlite_uri, tmp_path):
    MlflowClient(sqlite_uri).search_experiments()  # migrate before two processes race to
    mp.start_processes(_worker, args=(2, free_port(), sqlite_uri, str(tmp_path), stage), nprocs=2, join=True,
                       start_method="spawn")
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    assert r0["engine"] == "DeepSpeedEngine"  # the Trainer really trained under DeepSpeed
    trainer_norm = {int(k): v for k, v in r0["trainer_grad_norm"].items()}

    client = MlflowClient(sqlite_uri)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    rid = run.info.run_id

    def hist(key: str) -> dict[int, float]:
        return {m.step: m.value for m in client.get_metric_history(rid, key)}

    assert hist(keys.GRAD_FINITE) == {1: 1.0, 2: 0.0, 3: 1.0, 4: 1.0}
    norms = hist(keys.GRAD_NORM)
    assert math.isnan(norms[NAN_STEP])
    for step in (1, 3, 4):  # the norm DeepSpeed clipped by, as the Trainer logged it
        assert norms[step] == pytest.approx(trainer_norm[step], rel=1e-4), (step, norms, trainer_norm)
    tags = run.data.tags
    assert tags[keys.TAG_ALERT_FIRST_STEP] == str(NAN_STEP) and tags[keys.TAG_ALERT_COUNT] == "1"
    assert "rank1:lm_head.weight" in json.loads(tags[keys.TAG_ALERT_LAST])["params"]
