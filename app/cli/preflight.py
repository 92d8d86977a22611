"""`rldiag preflight`: the command line of `rldiag.app.preflight` (engine–trainer parity before a run)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from rldiag.app.cli.options import CliError

EXAMPLES = """\
Starts vLLM in-process with your engine arguments, samples a few prompts with your sampling settings,
pushes slightly changed weights (as the RL loop's weight sync does), samples again, and recomputes the
sampled tokens' logprobs with your model in transformers (float32, the same weights, your trainer's
sampling transform). Then it re-runs with each knob flipped and says which one explains the gap.
Exit status: 0 within --max-mismatch, 1 above it, 2 for bad input. Needs: pip install 'rldiag[vllm,hf]'
(plain `vllm` on a CUDA machine). Examples:
  rldiag preflight --model ./my-policy --temperature 0.7 --top-p 0.9
  rldiag preflight --model ./my-policy --engine-args engine.yaml --knobs logprobs_mode,prefix_caching
  rldiag preflight --model ./my-policy -e logprobs_mode=processed_logprobs -e dtype=bfloat16 --out preflight/
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from rldiag.app.preflight.config import KNOBS, TRAINER_LOGPROBS, PreflightConfig

    d = PreflightConfig.__dataclass_fields__
    p.epilog = EXAMPLES + "\nKnobs:\n" + "\n".join(f"  {k:18} {v}" for k, v in KNOBS.items())
    p.add_argument("--model", required=True, metavar="DIR",
                   help="the policy: a directory transformers and vLLM both load (config.json, weights, tokenizer)")
    p.add_argument("--engine-args", default=None, metavar="FILE",
                   help="vllm.LLM(...) keyword arguments as a YAML or JSON mapping (e.g. logprobs_mode: raw_logprobs)")
    p.add_argument("-e", "--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="one engine argument (repeatable; wins over --engine-args), VALUE read as YAML")
    p.add_argument("--temperature", type=float, default=d["temperature"].default, help="sampling temperature")
    p.add_argument("--top-p", type=float, default=d["top_p"].default, help="nucleus sampling")
    p.add_argument("--top-k", type=int, default=d["top_k"].default, help="top-k sampling (0: off)")
    p.add_argument("--trainer-logprobs", choices=list(TRAINER_LOGPROBS), default=d["trainer_logprobs"].default,
                   help="how your trainer scores the sampled tokens: " +
                        "; ".join(f"{k}: {v}" for k, v in TRAINER_LOGPROBS.items()))
    p.add_argument("--knobs", default="all", metavar="LIST",
                   help=f"comma-separated knobs to flip one at a time, from {', '.join(KNOBS)}; 'all' or 'none'")
    p.add_argument("--max-mismatch", type=float, default=d["max_mismatch"].default, metavar="X",
                   help="fail (exit 1) when the mean |trainer - engine logprob| is above X, or a sampled token "
                        "has probability 0 for the trainer")
    p.add_argument("--num-prompts", type=int, default=d["num_prompts"].default, help="prompts to sample")
    p.add_argument("--samples", type=int, default=d["samples"].default, help="completions per prompt")
    p.add_argument("--prompt-len", type=int, default=d["prompt_len"].default,
                   help="tokens of each random prompt (keep it above the KV block size so the prefix cache can hit)")
    p.add_argument("--max-tokens", type=int, default=d["max_tokens"].default, help="tokens per completion")
    p.add_argument("--prompts-file", default=None, metavar="FILE", help="text prompts, one a line, instead of random ones")
    p.add_argument("--push-scale", type=float, default=d["push_scale"].default,
                   help="the weight push: each matrix moves by this fraction of its standard deviation")
    p.add_argument("--reset-cache-on-push", action="store_true",
                   help="your trainer resets vLLM's prefix cache after each weight push (llm.reset_prefix_cache())")
    p.add_argument("--worst", type=int, default=d["worst"].default, help="worst tokens to list")
    p.add_argument("--seed", type=int, default=d["seed"].default, help="prompts, sampling and the weight push")
    p.add_argument("--trainer-device", default=d["trainer_device"].default, metavar="DEVICE",
                   help="where the float32 recompute runs (cpu, cuda, cuda:1); with cuda, lower vLLM's "
                        "gpu_memory_utilization so both fit")
    p.add_argument("--out", default=".", metavar="DIR", help="write preflight.json and preflight.md into DIR")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def config_from_args(args: argparse.Namespace):
    """A validated `PreflightConfig` (ValueError, one line, for bad input); reads the engine-args file."""
    from rldiag.app.preflight.config import KNOBS, PreflightConfig, load_engine_args, parse_engine_arg

    engine_args = load_engine_args(Path(args.engine_args)) if args.engine_args else {}
    engine_args.update(dict(parse_engine_arg(a) for a in args.engine_arg))
    wanted = args.knobs.strip()
    knobs = tuple(KNOBS) if wanted == "all" else () if wanted == "none" else \
        tuple(k.strip() for k in wanted.split(",") if k.strip())
    return PreflightConfig(
        model=Path(args.model), engine_args=engine_args, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, trainer_logprobs=args.trainer_logprobs, num_prompts=args.num_prompts,
        samples=args.samples, prompt_len=args.prompt_len, max_tokens=args.max_tokens,
        prompts_file=Path(args.prompts_file) if args.prompts_file else None, knobs=knobs,
        max_mismatch=args.max_mismatch, push_scale=args.push_scale, reset_cache_on_push=args.reset_cache_on_push,
        worst=args.worst, seed=args.seed, trainer_device=args.trainer_device)


def run(args: argparse.Namespace) -> int:
    """`rldiag preflight`: see `rldiag preflight --help`."""
    from rldiag.collectors.import_utils import is_available

    missing = [m for m in ("vllm", "transformers") if not is_available(m)]
    if missing:
        raise CliError(f"it needs {' and '.join(missing)}, not installed here: pip install 'rldiag[vllm,hf]' "
                       "(on a CUDA machine: pip install vllm 'rldiag[hf]')")
    cfg = config_from_args(args)  # before any engine: bad input costs no start-up
    # vLLM in-process (2-7 s a start instead of ~20 s), and quiet; a user's own settings win
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    # vLLM logs some import-time warnings (e.g. "Triton ... doesn't include CPU backend") before it
    # applies VLLM_LOGGING_LEVEL to its loggers: apply it first
    logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())
    from rldiag.collectors.integrations.vllm_engine import set_engine_env

    set_engine_env(in_process=True)
    from tqdm.auto import tqdm

    from rldiag.app.preflight.check import run_preflight
    from rldiag.app.preflight.render import to_markdown, write

    bar = tqdm(total=1 + len(cfg.knobs), unit="engine", disable=args.quiet, file=sys.stderr, leave=False)

    started: list[str] = []

    def progress(label: str) -> None:  # called as each engine starts: the previous one is done
        if started:
            bar.update(1)
        started.append(label)
        bar.set_description(f"engine {len(started)}/{bar.total}: {label}")

    try:
        result = run_preflight(cfg, progress=progress)
    finally:
        bar.close()
    json_path, md_path = write(result, Path(args.out))
    print(to_markdown(result))
    print(f"wrote {json_path} and {md_path}")
    return 0 if result.passed else 1
