"""`rldiag experiment NAME`: the reproductions in `rldiag.experiments`, one module each.

Each experiment module has `add_arguments(parser)` (its options; the tracking URI is added here) and
`run(args) -> int` (ValueError for bad input), and prints `rldiag.experiments.summary.format_summaries` at its end.
"""

from __future__ import annotations

import argparse
import importlib

from rldiag.app.cli.options import add_tracking_option

EXPERIMENTS: dict[str, tuple[str, str]] = {
    "masked-vs-unmasked": ("rldiag.experiments.masked_vs_unmasked",
                           "distillation with -inf padded teacher logprobs: NaN gradients behind a finite loss"),
    "engine-parity": ("rldiag.experiments.engine_parity",
                      "GSPO-style RL on real vLLM rollouts: V0-parity settings vs V1 defaults and each knob"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # not `experiment`: each experiment has an --experiment option (the MLflow experiment) of its own
    sub = parser.add_subparsers(dest="experiment_name", metavar="NAME", required=True)
    for name, (module, help_) in EXPERIMENTS.items():
        p = sub.add_parser(name, help=help_, description=help_,
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        importlib.import_module(module).add_arguments(p)
        add_tracking_option(p)


def run(args: argparse.Namespace) -> int:
    return importlib.import_module(EXPERIMENTS[args.experiment_name][0]).run(args)
