"""Step-time overhead of `RldiagCallback` on a transformers `Trainer` step, CPU.

    python -m bench.callback_overhead [--quick] [--blocks N] [--block-steps K] [--threads T]

A LlamaForCausalLM (vocab 512, hidden 128, 2 layers, 4 heads) on batches of 8 x 128 tokens, AdamW,
clipping at 1.0, `logging_steps=1` (the trainer logs every step, and the callback forwards every log).
Variants, each a `Trainer` over its own copy of the same initial model:
- bare: the Trainer alone;
- rldiag: the same with `RldiagCallback(...).attach(trainer)`, writing into a real SQLite store in a
  temp dir, journal on (post-accumulate-grad hooks, one host transfer per step, logs forwarded);
- rldiag_nostore (diagnostic): the same callback with a writer whose send does nothing and no
  journal, to split the overhead into "the callback" and "delivering to MLflow in-process".

Variants run in blocks of K steps (`trainer.train()` with `max_steps=K`) in rotating order (ABC, BCA,
CAB, ...), so machine noise hits them alike. A step's time is the wall time between consecutive
`on_step_end` calls: forward, backward, clipping, optimizer step, the trainer's logging and every
callback; the first step of a block (dataloader and run start) is left out. Process CPU time over the
same interval (all threads, the writer's included) is reported beside it.

torch runs on 1 thread by default (`--threads`): on a 2-core machine shared with other jobs, two
OpenMP threads stall at every barrier whenever a core is taken, and step times swing 2-5x from one
block to the next (measured here: 0.8x to 1.4x "overhead" between identical runs); one thread leaves
the second core to the writer's background thread, as the spare cores of a GPU host would.
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import bench  # noqa: F401 - sets MLFLOW_DISABLE_TELEMETRY
from bench._common import env_info, fresh_sqlite_db, quiet_mlflow, summarize_ms, summary_row, write_result

NAME = "callback_overhead"
GOAL = 1.05  # Trainer step with RldiagCallback <= 1.05x without


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer, shorter blocks")
    ap.add_argument("--blocks", type=int, default=12, help="blocks per variant")
    ap.add_argument("--block-steps", type=int, default=12, help="optimizer steps per block")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    args = ap.parse_args(argv)
    if args.quick:
        args.blocks, args.block_steps = 3, 6

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PrinterCallback, Trainer, TrainerCallback, TrainingArguments
    from transformers.utils import logging as hf_logging

    from rldiag.collectors import MetricWriter
    from rldiag.collectors.integrations.transformers import RldiagCallback
    from rldiag.collectors.session import RunSession

    quiet_mlflow()
    hf_logging.set_verbosity_error()
    logging.getLogger("rldiag").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)
    batch, seq = 8, 128
    base = LlamaForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (batch * args.block_steps, seq))
    data = [{"input_ids": row, "labels": row} for row in ids]

    class StepClock(TrainerCallback):
        """Wall and process CPU time (all threads: the writer's too) between consecutive step ends."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self.cpu: list[float] = []
            self._last: tuple[float, float] | None = None

        def on_train_begin(self, *a, **k):
            self._last = None

        def on_step_end(self, *a, **k):
            now = (time.perf_counter(), time.process_time())
            if self._last is not None:
                self.times.append(now[0] - self._last[0])
                self.cpu.append(now[1] - self._last[1])
            self._last = now

    with tempfile.TemporaryDirectory(prefix="rldiag-bench-") as d:
        work = Path(d)
        uri = fresh_sqlite_db(work / "store.db")
        sessions: list[RunSession] = []

        def make(variant: str) -> tuple[Trainer, StepClock]:
            targs = TrainingArguments(
                output_dir=str(work / variant), report_to="none", save_strategy="no", use_cpu=True,
                disable_tqdm=True, logging_steps=1, per_device_train_batch_size=batch, max_steps=args.block_steps,
                learning_rate=1e-4, max_grad_norm=1.0, seed=0, dataloader_num_workers=0,
            )
            clock = StepClock()
            trainer = Trainer(model=copy.deepcopy(base), args=targs, train_dataset=data, callbacks=[clock])
            trainer.remove_callback(PrinterCallback)  # disable_tqdm=True would print every log line
            if variant == "rldiag":
                RldiagCallback(experiment="bench-callback", run_name="overhead", tracking_uri=uri,
                               spill_dir=str(work / "spill")).attach(trainer)
            elif variant == "rldiag_nostore":  # same callback path, a writer whose send does nothing
                session = RunSession("bench-callback", run_name="nostore", tracking_uri=uri, spill_dir=None)
                session.writer.close()
                session.writer = MetricWriter(session.run_id, lambda run_id, metrics, tags: None, spill_dir=None)
                sessions.append(session)
                RldiagCallback(session).attach(trainer)
            return trainer, clock

        names = ["bare", "rldiag", "rldiag_nostore"]
        runs = {v: make(v) for v in names}
        for trainer, clock in runs.values():  # warm-up block each: allocator, first-call paths
            trainer.train()
            clock.times.clear()
            clock.cpu.clear()
        block_medians: dict[str, list[float]] = {v: [] for v in names}
        t_start = time.perf_counter()
        for b in range(args.blocks * len(names)):  # ABC, BCA, CAB, ...: each variant in each slot
            v = names[(b + b // len(names)) % len(names)]
            trainer, clock = runs[v]
            n = len(clock.times)
            trainer.train()
            block_medians[v].append(statistics.median(clock.times[n:]))
        wall = time.perf_counter() - t_start
        for session in sessions:
            session.close()

    summ = {v: summarize_ms(clock.times) for v, (_, clock) in runs.items()}
    cpu = {v: summarize_ms(clock.cpu) for v, (_, clock) in runs.items()}
    ratio = summ["rldiag"]["median_ms"] / summ["bare"]["median_ms"]
    ratio_blocks = statistics.median(r / b for r, b in zip(block_medians["rldiag"], block_medians["bare"]))
    ratio_cpu = cpu["rldiag"]["median_ms"] / cpu["bare"]["median_ms"]
    ratio_nostore = summ["rldiag_nostore"]["median_ms"] / summ["bare"]["median_ms"]
    out = {
        "benchmark": NAME, "env": env_info(), "torch_threads": torch.get_num_threads(),
        "model": {"arch": "LlamaForCausalLM", "vocab": cfg.vocab_size, "hidden": cfg.hidden_size,
                  "layers": cfg.num_hidden_layers, "params": sum(p.numel() for p in base.parameters())},
        "batch": [batch, seq], "blocks": args.blocks, "block_steps": args.block_steps, "wall_s": wall,
        "step": summ, "step_cpu": cpu, "ratio_rldiag_over_bare": ratio,
        "ratio_blockmedian_median": ratio_blocks, "ratio_cpu_rldiag_over_bare": ratio_cpu,
        "ratio_rldiag_nostore_over_bare": ratio_nostore,
    }
    print(f"Trainer step ms, median and p99 of {summ['bare']['n']} steps each, torch threads "
          f"{torch.get_num_threads()}:\n            wall     p99   CPU(all threads)")
    for v in names:
        print(f"  {v:<15}{summ[v]['median_ms']:8.1f}{summ[v]['p99_ms']:8.1f}{cpu[v]['median_ms']:8.1f}")
    print(f"with RldiagCallback / without: {ratio:.3f}x wall (median of per-block ratios {ratio_blocks:.3f}x), "
          f"{ratio_cpu:.3f}x CPU; without delivery to MLflow {ratio_nostore:.3f}x; goal <= {GOAL}x")
    out["summary"] = [summary_row(
        "CPU Trainer step with RldiagCallback (Llama 128x2, 8x128 tokens)",
        f"{summ['rldiag']['median_ms']:.1f} ms",
        f"without the callback {summ['bare']['median_ms']:.1f} ms",
        f"{ratio:.3f}x",
        f"<= {GOAL}x",
        ratio <= GOAL,
    )]
    print(f"wrote {write_result(NAME, out)}")
    return out


if __name__ == "__main__":
    main()
