"""The transformers callback under DDP: 2 real processes on gloo, a NaN gradient on rank 1 at one step.

Every rank must agree on the flag (else one rank steps while the other skips and the replicas part),
rank 0 alone writes and alerts, and nothing deadlocks.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the transformers callback needs the [hf] extra")

import torch.multiprocessing as mp  # noqa: E402
from mlflow import MlflowClient  # noqa: E402

from rldiag.collectors import keys  # noqa: E402
from tests.helpers.net import free_port  # noqa: E402

NAN_STEP = 2  # optimizer step (global_step after it) whose backward is NaN on rank 1


def _worker(rank: int, world: int, port: int, uri: str, out: str, attach: bool) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), MLFLOW_DISABLE_TELEMETRY="true")
    import torch
    from transformers import LlamaForCausalLM, Trainer, TrainerCallback

    from rldiag.collectors.integrations.transformers import RldiagCallback
    from tests.helpers.tiny_hf import llama_config, lm_dataset, training_args

    class NanOnRank1(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, **kw):
            loss = super().compute_loss(model, inputs, return_outputs=return_outputs, **kw)
            if rank == 1 and self.state.global_step == NAN_STEP - 1:  # finite forward, NaN backward
                w = self.model.module.lm_head.weight if hasattr(self.model, "module") else self.model.lm_head.weight
                loss = loss + 0.0 * ((w - w.detach()) ** 2).sum().sqrt()
            return loss

    class Weights(TrainerCallback):
        def __init__(self):
            self.finite, self.checksum = {}, {}

        def on_step_end(self, args, state, control, model=None, **kw):
            ps = [p.detach() for p in model.parameters()]
            self.finite[state.global_step] = all(bool(torch.isfinite(p).all()) for p in ps)
            self.checksum[state.global_step] = float(sum(p.double().sum() for p in ps))

    torch.manual_seed(0)
    args = training_args(Path(out) / f"rank{rank}", per_device_train_batch_size=2, max_steps=3,
                         ddp_backend="gloo")
    trainer = NanOnRank1(model=LlamaForCausalLM(llama_config()), args=args, train_dataset=lm_dataset(16))
    weights = Weights()
    trainer.add_callback(weights)
    cb = RldiagCallback(experiment="ddp", run_name="gloo", tracking_uri=uri, policy="skip",
                        spill_dir=os.path.join(out, f"spill{rank}"))
    if attach:
        cb.attach(trainer)
    else:  # as a stock script passes it: callbacks=[...] (added the same way), never attached
        trainer.add_callback(cb)
    trainer.train()
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "world": trainer.args.world_size, "finite": weights.finite, "checksum": weights.checksum,
        "had_session": cb._owns_session and rank == 0,
        "trainer_grad_norm": {h["step"]: h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h},
    }))
    from tests.helpers.gloo_job import teardown

    teardown()  # both ranks done before either tears gloo down, then out without finalization


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("attach", [True, False], ids=["attached", "callbacks-list"])
def test_nan_on_one_rank_every_rank_skips_that_step_and_rank_0_alerts(attach, sqlite_uri, tmp_path):
    MlflowClient(sqlite_uri).search_experiments()  # migrate before two processes race to
    mp.start_processes(_worker, args=(2, free_port(), sqlite_uri, str(tmp_path), attach), nprocs=2, join=True,
                       start_method="spawn")
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["world"] == r1["world"] == 2
    for r in (r0, r1):  # the NaN step was skipped on both ranks: weights stay finite
        assert all(r["finite"].values()), r
    assert r0["checksum"] == r1["checksum"]  # the replicas never parted

    client = MlflowClient(sqlite_uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1  # rank 0 writes; rank 1 opened no run
    rid = runs[0].info.run_id
    finite = {m.step: m.value for m in client.get_metric_history(rid, keys.GRAD_FINITE)}
    assert finite == {1: 1.0, 2: 0.0, 3: 1.0}
    norms = {m.step: m.value for m in client.get_metric_history(rid, keys.GRAD_NORM)}
    assert math.isnan(norms[NAN_STEP])
    # the finite steps' norm is of the averaged gradients, the Trainer's own `grad_norm` (before, the callback
    # logged the larger rank's norm before DDP's average: 1.89 where the Trainer had 1.33): recorded from
    # accelerate's clip_grad_norm_ when attached, else taken from the Trainer's logs (logging_steps=1 here)
    trainer_norm = {int(k): v for k, v in r0["trainer_grad_norm"].items()}
    for step in (1, 3):
        assert norms[step] == pytest.approx(trainer_norm[step], rel=1e-5), (norms, trainer_norm)
    assert sorted(m.step for m in client.get_metric_history(rid, keys.GRAD_NORM)) == [1, 2, 3]  # one point a step
    tags = runs[0].data.tags
    assert tags[keys.TAG_ALERT_FIRST_STEP] == str(NAN_STEP) and tags[keys.TAG_ALERT_COUNT] == "1"
    last = json.loads(tags[keys.TAG_ALERT_LAST])
    # names carry their rank; the NaN entered at rank 1's lm_head (DDP may spread it to rank 0's copy)
    assert "rank1:lm_head.weight" in last["params"], last
