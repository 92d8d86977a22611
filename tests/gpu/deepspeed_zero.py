"""rldiag's gradient check under DeepSpeed ZeRO 1, 2 and 3 on a CUDA machine: never a false all-clear.

NOT RUN: DeepSpeed's fp16 needs CUDA ("Type fp16 is not supported on your device" on a CPU); ZeRO 1-3 in
float32 and bf16 run on the CPU in tests/collectors/test_deepspeed.py. On a CUDA machine (one GPU is enough;
`deepspeed --num_gpus 2` for two ranks):

    pip install 'deepspeed>=0.19.8,<0.20' 'rldiag[hf]'
    deepspeed --num_gpus 1 tests/gpu/deepspeed_zero.py --stage 2
    deepspeed --num_gpus 2 tests/gpu/deepspeed_zero.py --stage 3

A tiny random-init Llama (built from a config, nothing downloaded) trains 4 steps under the DeepSpeed engine
in fp16 (DeepSpeed's own loss scaler); at step 2 a term that is 0 forward and NaN backward makes the
gradient of `lm_head.weight` NaN. `Monitor.step(step, engine, ...)` runs after `engine.backward` and before
`engine.step`, as in a plain loop. What must hold, and what the script prints:
  1. every step's gradients are found (ZeRO's partitions, read from the engine): never `grad/found` = 0;
  2. the NaN step reads non-finite, as a loss-scaler overflow (`grad/scaler_overflow`, no NaN alert: the
     loss is finite and DeepSpeed's scale is above 1), and DeepSpeed skips it (`engine.skipped_steps`);
  3. on the finite steps `grad/norm` is the unscaled norm, DeepSpeed's own `engine.get_global_grad_norm()`
     (within fp16's precision), and `grad/loss_scale` is DeepSpeed's scale.
Exit status 0 when 1 and 2 hold; each failure is printed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage", type=int, choices=(1, 2, 3), default=2, help="ZeRO stage")
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps")
    ap.add_argument("--nan-step", type=int, default=2, help="step whose backward makes lm_head's gradient NaN")
    ap.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    args = ap.parse_args()

    import deepspeed
    import mlflow
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rldiag.collectors import Monitor, keys

    deepspeed.init_distributed()
    rank = torch.distributed.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "fp16": {"enabled": True},
              "zero_optimization": {"stage": args.stage}, "gradient_clipping": 1.0}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    uri = f"sqlite:///{tempfile.mkdtemp()}/mlruns.db"
    failures, rows = [], []
    with Monitor("deepspeed", run_name=f"zero{args.stage}", tracking_uri=uri, policy="warn") as mon:
        for step in range(1, args.steps + 1):
            ids = torch.randint(2, 64, (2, 12), generator=torch.Generator().manual_seed(step + 10 * rank)).cuda()
            loss = engine(input_ids=ids, labels=ids).loss
            if step == args.nan_step:
                w = engine.module.lm_head.weight
                loss = loss + 0.0 * ((w - w.detach()) ** 2).sum().sqrt()
            engine.backward(loss)
            scale = float(engine.optimizer.loss_scale)
            mon.step(step, engine, loss=loss)
            report = mon.last_report
            engine.step()
            rows.append({"step": step, "found": report.found, "finite": report.finite, "norm": report.norm,
                         "overflow": report.overflow, "scale": scale,
                         "ds_norm": float(engine.get_global_grad_norm() or math.nan),
                         "ds_skipped": int(engine.skipped_steps)})
        run_id = mon.run_id
    if rank == 0:
        client = mlflow.MlflowClient(uri)
        finite = {m.step: m.value for m in client.get_metric_history(run_id, keys.GRAD_FINITE)}
        found = {m.step: m.value for m in client.get_metric_history(run_id, keys.GRAD_FOUND)}
        for r in rows:
            s = r["step"]
            if not r["found"] or found.get(s) == 0.0:
                failures.append(f"step {s}: no gradient found (ZeRO's partitions not read)")
            if s == args.nan_step and (r["finite"] or not r["overflow"]):
                failures.append(f"step {s}: the NaN step read finite={r['finite']}, overflow={r['overflow']}")
            if s != args.nan_step and not (r["finite"] and math.isclose(r["norm"], r["ds_norm"], rel_tol=1e-2)):
                failures.append(f"step {s}: norm {r['norm']} is not DeepSpeed's {r['ds_norm']} (finite={r['finite']})")
            if s != args.nan_step and finite.get(s) != 1.0:
                failures.append(f"step {s}: grad/finite = {finite.get(s)} logged, not 1")
        print(json.dumps({"stage": args.stage, "rows": rows}, indent=1, default=str))
        for f in failures:
            print("FAILED:", f)
        print("ok" if not failures else f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
