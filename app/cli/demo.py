"""`rldiag demo`: the example RL loop (`rldiag.experiments.example_loop`) watched by rldiag, into the store."""

from __future__ import annotations

import argparse

from rldiag.app.cli.options import CliError, add_tracking_option, non_negative_int, positive_int


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = "A tiny policy trained by a GRPO-style loop, watched by rldiag.Monitor."
    p.add_argument("--steps", type=positive_int, default=40, help="rollout steps (default: 40)")
    p.add_argument("--nan-at", type=non_negative_int, default=None, metavar="STEP",
                   help="inject a NaN gradient (finite loss) at this optimizer step (default: none)")
    p.add_argument("--policy", choices=("warn", "skip", "raise"), default="skip",
                   help="what to do on non-finite gradients (default: skip)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    p.add_argument("--experiment", default="rldiag-demo", help="MLflow experiment (default: rldiag-demo)")
    add_tracking_option(p)


def run(args: argparse.Namespace) -> int:
    from rldiag.collectors.settings import default_tracking_uri
    from rldiag.collectors.uri import redact_uri
    from rldiag.experiments.example_loop import LoopConfig
    from rldiag.experiments.example_loop import run as run_loop

    uri = args.tracking_uri or default_tracking_uri()
    try:
        cfg = LoopConfig(steps=args.steps, nan_at=args.nan_at, policy=args.policy, seed=args.seed,
                         experiment=args.experiment)
    except ValueError as e:
        raise CliError(str(e).replace("nan_at=", "--nan-at ").replace("steps=", "--steps ")) from None
    res = run_loop(cfg, tracking_uri=uri)
    bad = "none" if res.first_nonfinite_step is None else str(res.first_nonfinite_step)
    print(f"run {res.run_id}  variant example-loop  first non-finite step: {bad}  final reward: {res.final_reward:.3f}")
    print(f"Logged to {redact_uri(uri)} (experiment {args.experiment!r}). Look at it with:")
    print(f"  rldiag app --experiment {args.experiment}" + ("" if args.tracking_uri is None else
                                                          f" --tracking-uri {redact_uri(uri)}"))
    return 0 if res.undelivered == 0 else 1
