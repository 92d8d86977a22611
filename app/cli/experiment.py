"""`rldiag experiment NAME`: the reproductions in `rldiag.experiments`, one module each.

Each experiment module has `add_arguments(parser)` (its options; the tracking URI is added here) and
`run(args) -> int` (ValueError for bad input), and prints `rldiag.experiments.summary.format_summaries` at its end,
then calls `args.on_done(run_ids, tracking_uri)` where set: here, the table of each candidate's verdict,
first departure and likely cause (`rldiag.app.cli.verdict_table`).
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
    sub = parser.add_subparsers(dest="experiment_name", metavar="NAME", required=True, parser_class=_ExperimentParser)
    for name, (module, help_) in EXPERIMENTS.items():
        sub.add_parser(name, help=help_, description=help_, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       module=module)


class _ExperimentParser(argparse.ArgumentParser):
    """An experiment's options, added when that experiment is parsed or its help shown: its module imports
    torch (and vLLM's adapter), seconds that `rldiag experiment --help` and the other experiment need not pay."""

    def __init__(self, *args, module: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._module = module

    def _load(self) -> None:
        if self._module is not None:
            module, self._module = self._module, None
            importlib.import_module(module).add_arguments(self)
            add_tracking_option(self)

    def parse_known_args(self, args=None, namespace=None):
        self._load()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self._load()
        return super().format_help()


def run(args: argparse.Namespace) -> int:
    from rldiag.app.cli.verdict_table import print_verdicts

    # the experiment calls it with its run ids and the store once its runs are logged: the closing table
    args.on_done = print_verdicts
    return importlib.import_module(EXPERIMENTS[args.experiment_name][0]).run(args)
